"""A sharded index directory: written, loaded and checked shard by shard."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import faiss
import numpy as np
import pytest

from specrag.errors import ArtifactError, InvalidInputError
from specrag.retrieval.backends.shards.merge import ShardedSearcher
from specrag.retrieval.backends.shards.store import ShardManifest, load_shard, shard_directory
from specrag.retrieval.corpus import Passage
from specrag.retrieval.index_store import (
    INDEX_FILE,
    MANIFEST_FILE,
    IndexConfig,
    build_index,
    check_corpus,
    load_index,
    save_index,
)
from specrag.retrieval.search.stages import StagePlan


def config(kind: str, shards: int, seed: int = 0) -> IndexConfig:
    return IndexConfig(
        kind=kind, embedder="tfidf-svd", embedding_dim=16, ef_search=16, shards=shards, seed=seed
    )


@pytest.fixture(scope="module", params=["ivf-sq8", "hnsw"])
def saved(
    request: pytest.FixtureRequest, passages: list[Passage], tmp_path_factory: pytest.TempPathFactory
) -> Path:
    directory = tmp_path_factory.mktemp("sharded") / "index"
    save_index(build_index(passages, config(request.param, 3)), directory)
    return directory


def copy_of(saved: Path, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(saved, target)
    return target


def test_a_saved_sharded_index_loads_as_shards_and_searches_as_built(
    saved: Path, passages: list[Passage]
) -> None:
    index = load_index(saved)
    assert isinstance(index.searcher, ShardedSearcher) and len(index.searcher.shards) == 3
    assert index.searcher.ntotal == len(passages)
    assert all(shard_directory(saved, number).is_dir() for number in range(3))
    kind = "hnsw" if index.searcher.kind == "hnsw" else "ivf-sq8"
    built = build_index(passages, config(kind, 3))
    query = index.embed_query("asyncio event loop")
    loaded = list(index.search_staged(query, 5, StagePlan(3, "equal"), query_text="asyncio event loop"))
    fresh = list(built.search_staged(query, 5, StagePlan(3, "equal"), query_text="asyncio event loop"))
    np.testing.assert_array_equal(loaded[-1].ids, fresh[-1].ids)


def test_a_sharded_ivf_index_finds_what_the_unsharded_one_finds(passages: list[Passage]) -> None:
    whole, sharded = build_index(passages, config("ivf", 1)), build_index(passages, config("ivf", 4))
    for text in ("asyncio event loop", "dictionary keys", "file io paths"):
        query = whole.embed_query(text)
        plan = StagePlan(3, "geometric")
        first = list(whole.search_staged(query, 8, plan, query_text=text))
        second = list(sharded.search_staged(query, 8, plan, query_text=text))
        for one, other in zip(first, second, strict=True):
            np.testing.assert_array_equal(one.ids, other.ids)


def test_a_missing_shard_is_named(saved: Path, tmp_path: Path) -> None:
    directory = copy_of(saved, tmp_path)
    shutil.rmtree(shard_directory(directory, 2))
    with pytest.raises(ArtifactError, match="shard-002"):
        load_index(directory)


def test_a_shard_count_that_disagrees_with_the_shards_is_refused(saved: Path, tmp_path: Path) -> None:
    directory = copy_of(saved, tmp_path)
    manifest = json.loads((directory / MANIFEST_FILE).read_text(encoding="utf-8"))
    manifest["searcher"]["shards"] = 2
    (directory / MANIFEST_FILE).write_text(json.dumps(manifest), encoding="utf-8")
    with pytest.raises(ArtifactError, match="names 2 shards"):
        load_index(directory)


def test_a_damaged_shard_file_is_named(saved: Path, tmp_path: Path) -> None:
    directory = copy_of(saved, tmp_path)
    path = shard_directory(directory, 1) / INDEX_FILE
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(ArtifactError, match="shard-001"):
        load_index(directory)


def test_a_shard_of_another_build_is_refused(passages: list[Passage], tmp_path: Path) -> None:
    first, other = tmp_path / "first", tmp_path / "other"
    save_index(build_index(passages, config("ivf", 2)), first)
    save_index(build_index(passages, config("ivf", 2, seed=5)), other)
    ours = json.loads((first / MANIFEST_FILE).read_text(encoding="utf-8"))["searcher"]["quantizer_sha256"]
    with pytest.raises(ArtifactError, match="quantizer is not the index's"):
        load_shard(shard_directory(other, 1), 1, 2, ours)
    with pytest.raises(ArtifactError, match="expected shard 0 of 2"):
        load_shard(shard_directory(first, 1), 0, 2, ours)
    shard_directory(first, 1).unlink()  # a pointer to the shard's version (specrag.atomic)
    shutil.copytree(shard_directory(other, 1), shard_directory(first, 1))
    with pytest.raises(ArtifactError, match="shard-001"):
        load_index(first)


def test_a_shard_loads_memory_mapped(saved: Path) -> None:
    manifest = json.loads((saved / MANIFEST_FILE).read_text(encoding="utf-8"))["searcher"]
    shard = load_shard(shard_directory(saved, 0), 0, 3, manifest["quantizer_sha256"], mmap=True)
    assert shard.ntotal == load_index(saved).searcher.shards[0].ntotal  # type: ignore[attr-defined]


def test_without_shard_vectors_only_the_manifests_are_read(
    saved: Path, passages: list[Passage], monkeypatch: pytest.MonkeyPatch
) -> None:
    def refused(*args: object) -> None:
        raise AssertionError("a shard's vectors were read")

    monkeypatch.setattr(faiss, "read_index", refused)
    index = load_index(saved, shard_vectors=False)
    assert isinstance(index.searcher, ShardedSearcher) and len(index.searcher.shards) == 3
    assert all(isinstance(shard, ShardManifest) for shard in index.searcher.shards)
    assert index.searcher.ntotal == len(passages) and index.passage_ids == [p.id for p in passages]
    check_corpus(index, passages)
    with pytest.raises(InvalidInputError, match="not loaded in this process"):
        list(index.search_staged(index.embed_query("dictionary keys"), 5, StagePlan(3, "equal")))
    # A row added (the live log replayed at start) is kept for the actor of the shard owning it.
    first = index.searcher.next_row
    index.searcher.add(np.ones((1, index.dim), dtype=np.float32), first)
    owner = index.searcher.shards[first % 3]
    assert isinstance(owner, ShardManifest) and index.searcher.ntotal == len(passages) + 1
    vectors, rows = owner.added.since(owner.added.base)
    assert rows.tolist() == [first] and vectors.tolist() == [[1.0] * index.dim]


def test_without_shard_vectors_a_shard_of_another_build_is_still_refused(saved: Path, tmp_path: Path) -> None:
    directory = copy_of(saved, tmp_path)
    shutil.rmtree(shard_directory(directory, 2))
    with pytest.raises(ArtifactError, match="shard-002"):
        load_index(directory, shard_vectors=False)
    directory = copy_of(saved, tmp_path / "again")
    path = shard_directory(directory, 1) / MANIFEST_FILE
    manifest = json.loads(path.read_text(encoding="utf-8"))
    manifest["quantizer_sha256"] = "0" * 64
    path.write_text(json.dumps(manifest), encoding="utf-8")
    with pytest.raises(ArtifactError, match="shard-001"):  # its manifest's checksum
        load_index(directory, shard_vectors=False)
