"""``prepare`` embeds with the embedder it is told (rebuilding an index of another); ``serve``
refuses an index embedded by another embedder than its query embedder, naming both."""

from __future__ import annotations

from pathlib import Path

import pytest

from specrag.cli import main
from specrag.errors import InvalidInputError
from specrag.paths import DataLayout
from specrag.retrieval.corpus import Passage, write_passages
from specrag.retrieval.index_store import EMBEDDER_ENV, MINILM, WORDLLAMA, IndexConfig, recorded_embedder
from specrag.service.run.assets import ensure_index

pytest.importorskip("transformers", reason="MiniLM runs on torch and transformers (the engine's)")


@pytest.fixture
def passages(default_corpus: list[Passage], monkeypatch: pytest.MonkeyPatch) -> list[Passage]:
    """A few passages, and MiniLM the default embedder again (the test session's is WordLlama)."""
    monkeypatch.delenv(EMBEDDER_ENV)
    return default_corpus[:24]


def test_serving_refuses_an_index_of_another_embedder_and_prepare_rebuilds_it(
    tmp_path: Path, passages: list[Passage]
) -> None:
    layout = DataLayout(tmp_path / "data")
    ensure_index(layout, passages, IndexConfig(embedder=WORDLLAMA, nlist=2))
    with pytest.raises(InvalidInputError, match=r"embedded by wordllama-idf .*the query embedder is minilm"):
        ensure_index(layout, passages, IndexConfig(nlist=2), refuse_other_embedder=True)
    assert (recorded_embedder(layout.index_dir) or {}).get("kind") == "wordllama-idf"  # left as it was
    index = ensure_index(layout, passages, IndexConfig(nlist=2))
    assert getattr(index.embedder, "kind", None) == MINILM
    assert ensure_index(layout, passages, IndexConfig(nlist=2), refuse_other_embedder=True).dim == index.dim


def test_serve_exits_2_naming_both_embedders(
    tmp_path: Path, passages: list[Passage], tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = tmp_path / "corpus.jsonl"
    write_passages(corpus, passages)
    common = ["--data-dir", str(tmp_path / "data"), "--model", str(tiny_model_dir)]
    assert main(["prepare", *common, "--corpus", str(corpus), "--embedder", WORDLLAMA]) == 0
    assert main(["serve", *common, "--port", "0"]) == 2
    error = capsys.readouterr().err
    assert "wordllama-idf" in error and "minilm (weights sha256" in error and "--embedder" in error
