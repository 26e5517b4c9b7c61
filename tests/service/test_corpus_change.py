"""A changed corpus is said at WARNING, and one that lost passages replaces nothing unless accepted."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from specrag.cli import main
from specrag.paths import DataLayout
from specrag.pipeline.store.document_store import corpus_checksum
from specrag.retrieval.corpus import Passage, write_passages
from specrag.retrieval.corpus_change import CorpusChange, CorpusShrunkError
from specrag.retrieval.index_store import built_corpus_checksum, built_passage_ids
from specrag.service.run.assets import ensure_assets


def corpus(passages: list[Passage], path: Path) -> Path:
    write_passages(path, passages)
    return path


@pytest.fixture
def built(tmp_path: Path, default_corpus: list[Passage], tiny_model_dir: Path) -> DataLayout:
    """A data directory whose store and index were built from 60 passages."""
    layout = DataLayout(tmp_path / "data")
    ensure_assets(layout, tiny_model_dir, corpus(default_corpus[:60], tmp_path / "full.jsonl"))
    return layout


def test_a_shrunken_corpus_is_refused_and_replaces_nothing(
    built: DataLayout, default_corpus: list[Passage], tiny_model_dir: Path, tmp_path: Path
) -> None:
    store_files = {path: path.read_bytes() for path in (built.root / "store").glob("*.sqlite")}
    recorded = built.corpus_file.read_bytes()
    short = corpus(default_corpus[:30], tmp_path / "short.jsonl")
    with pytest.raises(
        CorpusShrunkError, match=r"60 passages before, 30 now: 0 added, 30 removed.*--accept-corpus-change"
    ):
        ensure_assets(built, tiny_model_dir, short)
    assert built_passage_ids(built.index_dir) == [p.id for p in default_corpus[:60]]
    assert {path: path.read_bytes() for path in store_files} == store_files
    assert built.corpus_file.read_bytes() == recorded  # not even the recorded copy is replaced


def test_a_corpus_cut_short_in_place_is_refused_too(built: DataLayout, tiny_model_dir: Path) -> None:
    """The issue's case: the data directory's own corpus file cut at a line boundary."""
    lines = built.corpus_file.read_text().splitlines(keepends=True)
    built.corpus_file.write_text("".join(lines[:45]))
    with pytest.raises(CorpusShrunkError, match="15 removed"):
        ensure_assets(built, tiny_model_dir)


def test_an_accepted_change_is_said_at_warning_and_adopted(
    built: DataLayout,
    default_corpus: list[Passage],
    tiny_model_dir: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    changed = corpus(default_corpus[10:70], tmp_path / "changed.jsonl")
    with caplog.at_level(logging.WARNING):
        assets = ensure_assets(built, tiny_model_dir, changed, accept_corpus_change=True)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("60 passages before, 60 now: 10 added, 10 removed" in message for message in warnings), (
        warnings
    )
    assert assets.index.passage_ids == [p.id for p in default_corpus[10:70]]
    assert len(assets.store) == 60 and assets.store.passage(0).id == default_corpus[10].id


def test_a_grown_corpus_needs_no_flag_but_is_said(
    built: DataLayout,
    default_corpus: list[Passage],
    tiny_model_dir: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    grown = corpus(default_corpus[:65], tmp_path / "grown.jsonl")
    with caplog.at_level(logging.WARNING):
        assets = ensure_assets(built, tiny_model_dir, grown)
    assert "60 passages before, 65 now: 5 added, 0 removed" in caplog.text
    assert len(assets.index.passage_ids) == 65


def test_prepare_refuses_a_shrunken_corpus_with_a_clear_message(
    built: DataLayout,
    default_corpus: list[Passage],
    tiny_model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    short = corpus(default_corpus[:59], tmp_path / "short.jsonl")
    arguments = [
        "prepare",
        "--data-dir",
        str(built.root),
        "--model",
        str(tiny_model_dir),
        "--corpus",
        str(short),
    ]
    assert main(arguments) == 2
    error = capsys.readouterr().err
    assert "1 removed" in error and "--accept-corpus-change" in error
    assert main([*arguments, "--accept-corpus-change"]) == 0
    assert built_passage_ids(built.index_dir) == [p.id for p in default_corpus[:59]]


def test_a_change_names_the_removed_ids() -> None:
    change = CorpusChange.between(
        [f"p{i}" for i in range(9)], [Passage("p0", "", "x"), Passage("new", "", "y")]
    )
    assert change.describe() == (
        "9 passages before, 2 now: 1 added, 8 removed ('p1', 'p2', 'p3', 'p4', 'p5' and 3 more)"
    )


def test_texts_changed_under_the_same_ids_rebuild_the_index_too(
    built: DataLayout,
    default_corpus: list[Passage],
    tiny_model_dir: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    edited = [*default_corpus[:59], Passage(default_corpus[59].id, "New title", "an entirely new text")]
    with caplog.at_level(logging.WARNING):
        assets = ensure_assets(built, tiny_model_dir, corpus(edited, tmp_path / "edited.jsonl"))
    assert "rebuilding the vector index" in caplog.text and "other titles or texts" in caplog.text
    assert built_corpus_checksum(built.index_dir) == corpus_checksum(edited)
    assert assets.store.passage(59).text == "an entirely new text"
