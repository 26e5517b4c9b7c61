from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from specrag.errors import ArtifactError, InvalidInputError
from specrag.retrieval.corpus import Passage
from specrag.retrieval.index_store import (
    INDEX_FILE,
    MANIFEST_FILE,
    PASSAGE_IDS_FILE,
    IndexConfig,
    build_index,
    check_corpus,
    load_index,
    save_index,
)
from specrag.retrieval.search.stages import StagePlan


@pytest.fixture(scope="module", params=["ivf", "ivf-sq8", "hnsw", "ivf-tfidf"])
def saved(
    request: pytest.FixtureRequest, passages: list[Passage], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """The default hybrid index (IVF flat or SQ8, or HNSW), and a dense TF-IDF one, saved."""
    directory = tmp_path_factory.mktemp("index") / "index"
    config = IndexConfig(kind=request.param.removesuffix("-tfidf"), embedding_dim=16, ef_search=16)
    if request.param.endswith("-tfidf"):
        config = IndexConfig(embedder="tfidf-svd", lexical=False, embedding_dim=16)
    save_index(build_index(passages, config), directory)
    return directory


def embedder_file(directory: Path) -> str:
    manifest = json.loads((directory / MANIFEST_FILE).read_text(encoding="utf-8"))
    name: str = manifest["embedder"]["files"][0]
    return name


def test_round_trip_gives_the_same_results(saved: Path, passages: list[Passage]) -> None:
    index = load_index(saved)
    original_dir = saved.parent / "again"
    save_index(index, original_dir)
    again = load_index(original_dir)
    query = index.embed_query("asyncio event loop")
    np.testing.assert_array_equal(query, again.embed_query("asyncio event loop"))
    first = list(index.search_staged(query, 5, StagePlan(3, "equal")))[-1]
    second = list(again.search_staged(query, 5, StagePlan(3, "equal")))[-1]
    np.testing.assert_array_equal(first.ids, second.ids)
    assert again.searcher.settings == index.searcher.settings  # the kind and codes survive
    assert index.passage_ids == [p.id for p in passages]
    assert "asyncio" in passages[int(index.passage_index_of(first.ids)[0])].title
    check_corpus(index, passages)
    with pytest.raises(ArtifactError, match="not the one"):
        check_corpus(index, passages[::-1])


def copy_of(saved: Path, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(saved, target)
    return target


def test_missing_directory_names_the_manifest(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match=MANIFEST_FILE):
        load_index(tmp_path / "nowhere")


def test_corrupt_manifest_is_named(saved: Path, tmp_path: Path) -> None:
    directory = copy_of(saved, tmp_path)
    (directory / MANIFEST_FILE).write_text("{not json", encoding="utf-8")
    with pytest.raises(ArtifactError, match=MANIFEST_FILE):
        load_index(directory)


@pytest.mark.parametrize("name", [INDEX_FILE, PASSAGE_IDS_FILE, "embedder", "lexical/vocab.index.json"])
def test_truncated_file_is_named(saved: Path, tmp_path: Path, name: str) -> None:
    directory = copy_of(saved, tmp_path)
    name = embedder_file(directory) if name == "embedder" else name
    if not (directory / name).exists():
        pytest.skip(f"this index has no {name}")
    data = (directory / name).read_bytes()
    (directory / name).write_bytes(data[: len(data) // 2])
    with pytest.raises(ArtifactError, match=name):
        load_index(directory)


def test_missing_file_is_named(saved: Path, tmp_path: Path) -> None:
    directory = copy_of(saved, tmp_path)
    name = embedder_file(directory)
    (directory / name).unlink()
    with pytest.raises(ArtifactError, match=name):
        load_index(directory)


def test_mismatched_manifest_is_detected(saved: Path, tmp_path: Path) -> None:
    directory = copy_of(saved, tmp_path)
    manifest = json.loads((directory / MANIFEST_FILE).read_text(encoding="utf-8"))
    manifest["dim"] += 1
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest), encoding="utf-8")
    with pytest.raises(ArtifactError, match=INDEX_FILE):
        load_index(directory)


def test_padded_index_maps_every_row_to_a_passage(passages: list[Passage], tmp_path: Path) -> None:
    index = build_index(passages, IndexConfig(embedding_dim=16, pad_to=1000))
    assert index.searcher.ntotal == 1000
    save_index(index, tmp_path / "padded")
    loaded = load_index(tmp_path / "padded")
    rows = np.arange(-1, 1000)
    mapped = loaded.passage_index_of(rows)
    assert mapped[0] == -1 and (mapped[1 : len(passages) + 1] == np.arange(len(passages))).all()
    assert mapped[1:].min() >= 0 and mapped.max() < len(passages)
    final = list(loaded.search_staged(loaded.embed_query("dictionary keys"), 20))[-1]
    assert len(loaded.passage_ids_of(final.ids)) == 20
    with pytest.raises(InvalidInputError):
        loaded.passage_index_of(np.array([1000]))


def test_empty_corpus_and_unknown_kind_are_rejected() -> None:
    with pytest.raises(InvalidInputError, match="empty"):
        build_index([], IndexConfig())
    with pytest.raises(InvalidInputError, match="kind"):
        IndexConfig(kind="lsh")


_REWRITER = """
import sys
from pathlib import Path
from specrag.retrieval.index_store import load_index, save_index

source, target, writes = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
index = load_index(source)
print("ready", flush=True)
for _ in range(writes):
    save_index(index, target)
"""


def test_an_index_rewritten_by_another_process_always_loads_whole(
    passages: list[Passage], tmp_path: Path
) -> None:
    """a load (a `serve` starting) while another process replaces the index never finds
    it missing or half written, so it never rebuilds it for that reason."""
    import os
    import subprocess
    import sys

    saved, target = tmp_path / "source", tmp_path / "index"
    save_index(
        build_index(passages, IndexConfig(embedder="tfidf-svd", lexical=False, embedding_dim=16)), saved
    )
    save_index(load_index(saved), target)
    rewriter = subprocess.Popen(
        [sys.executable, "-c", _REWRITER, str(saved), str(target), "40"],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert rewriter.stdout is not None and rewriter.stdout.readline().strip() == "ready"
    loads = 0
    while rewriter.poll() is None:
        load_index(target)  # raises ArtifactError on a missing or partial index
        loads += 1
    assert rewriter.returncode == 0 and loads > 0
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == sorted(
        ["source", os.readlink(saved), "index", os.readlink(target)]
    )


@pytest.mark.parametrize("embedder", ["wordllama", "tfidf-svd"])
def test_every_embedder_ticks_the_embedding_bar(
    embedder: str, passages: list[Passage], capsys: pytest.CaptureFixture[str]
) -> None:
    """A build's progress bar, whichever embedder it fits (WordLlama's one pass included)."""
    texts = [passage.text for passage in passages]
    IndexConfig(embedder=embedder, embedding_dim=16).fit_and_embed(texts, progress=True)
    assert "embedding passages: 100%|" in capsys.readouterr().err
