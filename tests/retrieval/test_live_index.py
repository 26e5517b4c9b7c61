"""A live index: rows appended and hidden while it serves, in every stage and both channels."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from specrag.errors import InvalidInputError
from specrag.retrieval.lexical import LexicalIndex
from specrag.retrieval.live_index import ReadWriteLock, Visibility
from specrag.retrieval.staged_hnsw import StagedHNSW
from specrag.retrieval.staged_ivf import StagedIVF
from specrag.retrieval.synthetic import GaussianMixture
from specrag.retrieval.vector_index import VectorIndex

TEXTS = [f"passage {i} about topic{i % 40} and theme{i % 7}" for i in range(6000)]


def live_index(vectors: np.ndarray, lexical: bool = False) -> VectorIndex:
    """A fresh index per test: a live one changes."""
    return VectorIndex(
        StagedIVF.build(vectors, nlist=64, nprobe=24),
        [f"p{i}" for i in range(len(vectors))],
        lexical=LexicalIndex.build(TEXTS[: len(vectors)]) if lexical else None,
    )


def every_stage(index: VectorIndex, query: np.ndarray, k: int, text: str | None = None) -> list[list[int]]:
    return [list(index.ranked_rows(stage.ids)) for stage in index.search_staged(query, k, query_text=text)]


def test_an_added_vector_is_found_in_every_stage_and_a_replaced_one_in_none(vectors: np.ndarray) -> None:
    index = live_index(vectors)
    query = vectors[17]
    assert every_stage(index, query, 5)[-1][0] == 17
    (row,) = index.apply_changes(["p17"], vectors[17:18], ["new text"], retired=[17])
    assert row == len(vectors) and index.passage_ids[row] == "p17"
    stages = every_stage(index, query, 5)
    assert all(17 not in stage for stage in stages)
    assert stages[-1][0] == row and all(len(stage) == 5 for stage in stages)
    _, ids = index.search(query, 5)
    assert ids[0] == row and 17 not in ids.tolist() and len(ids) == 5


def test_hidden_rows_are_never_returned_and_k_visible_rows_remain(
    vectors: np.ndarray, queries: np.ndarray
) -> None:
    index = live_index(vectors)
    _, before = index.search(queries[:50], 10, batch=True)
    hidden = sorted(set(before[:, :5].ravel().tolist()))
    index.apply_changes([], np.zeros((0, index.dim), dtype=np.float32), [], retired=hidden)
    assert index.hidden_rows == len(hidden)
    _, after = index.search(queries[:50], 10, batch=True)
    assert not set(after.ravel().tolist()) & set(hidden)
    assert (after >= 0).all()  # read deeper, so ten visible rows each


def test_hybrid_search_finds_an_added_documents_new_word_and_drops_deleted_ones(vectors: np.ndarray) -> None:
    index = live_index(vectors, lexical=True)
    query = vectors[3]
    (row,) = index.apply_changes(["new"], vectors[900:901], ["zanzibar quokka fact"], retired=[])
    assert every_stage(index, vectors[900], 5, "zanzibar quokka")[-1][0] == row
    index.apply_changes([], np.zeros((0, index.dim), dtype=np.float32), [], retired=[row, 3])
    for stage in every_stage(index, query, 5, "zanzibar quokka topic3"):
        assert row not in stage and 3 not in stage


def test_a_search_sees_the_corpus_as_it_was_when_it_started(vectors: np.ndarray) -> None:
    index = live_index(vectors)
    search = iter(index.search_staged(vectors[5], 5))
    first = next(search)
    index.apply_changes(["p5"], vectors[5:6], ["v2"], retired=[5])
    rest = list(search)
    assert 5 in first.ids.tolist() + rest[-1].ids.tolist() and len(vectors) not in rest[-1].ids.tolist()
    assert every_stage(index, vectors[5], 5)[-1][0] == len(vectors)


def test_an_index_that_cannot_grow_says_so(vectors: np.ndarray) -> None:
    index = VectorIndex(StagedHNSW.build(vectors[:500], m=8, ef_search=16), [f"p{i}" for i in range(500)])
    with pytest.raises(InvalidInputError, match="cannot take documents while it serves"):
        index.apply_changes(["x"], vectors[:1], ["x"], retired=[])
    index.apply_changes([], np.zeros((0, index.dim), dtype=np.float32), [], retired=[7])  # hiding works
    assert 7 not in index.search(vectors[7], 5)[1].tolist()


@pytest.mark.parametrize("hidden", [[], [0, 1, 2]])
def test_adds_while_searches_run_neither_crash_nor_lose_rows(
    vectors: np.ndarray, queries: np.ndarray, hidden: list[int]
) -> None:
    index = live_index(vectors[:3000])
    index.apply_changes([], np.zeros((0, index.dim), dtype=np.float32), [], retired=hidden)
    errors: list[BaseException] = []
    stop = threading.Event()

    def search() -> None:
        try:
            while not stop.is_set():
                for stage in index.search_staged(queries[:8], 5, batch=True):
                    assert stage.ids.shape == (8, 5)
                    index.ranked_rows(stage.ids[0])  # rows added since the search began map to none
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=search) for _ in range(2)]
    for thread in threads:
        thread.start()
    for start in range(3000, 3400, 20):
        index.apply_changes([f"n{start + i}" for i in range(20)], vectors[start : start + 20], ["t"] * 20, [])
    stop.set()
    for thread in threads:
        thread.join()
    assert not errors and index.searcher.ntotal == 3400
    assert index.search(vectors[3399], 1)[1][0] == 3399


def test_added_rows_must_continue_the_index() -> None:
    visibility = Visibility(np.array([0, 1, -1]), 0)
    with pytest.raises(InvalidInputError, match="continue the index at row 2"):
        visibility.changed([3], [])
    assert visibility.changed([2], [0]).row_to_passage.tolist() == [-1, 1, 2, -1]


def test_a_writer_waits_for_the_readers_in_flight() -> None:
    lock = ReadWriteLock()
    order: list[str] = []

    def write() -> None:
        with lock.writing():
            order.append("write")

    with lock.reading():
        writer = threading.Thread(target=write)
        writer.start()
        writer.join(0.1)
        assert writer.is_alive()  # blocked by the reader
        order.append("read")
    writer.join(5)
    assert order == ["read", "write"]


@pytest.mark.parametrize("codes", ["flat", "sq8"])
def test_compaction_drops_hidden_rows_and_changes_no_result(
    vectors: np.ndarray, queries: np.ndarray, codes: str
) -> None:
    index = VectorIndex(
        StagedIVF.build(vectors, nlist=64, nprobe=24, codes=codes), [f"p{i}" for i in range(6000)]
    )
    index.apply_changes(["p1"], vectors[1:2], ["t"], retired=list(range(0, 6000, 3)))
    assert index.removable_rows == 2000
    before = [index.search(query, 10)[1].tolist() for query in queries[:40]]
    old = index.searcher
    assert index.compact() == 2000
    assert index.searcher is not old and index.searcher.ntotal == 4001 and index.removable_rows == 0
    assert [index.search(query, 10)[1].tolist() for query in queries[:40]] == before
    (row,) = index.apply_changes(["p3"], vectors[3:4], ["t"], retired=[])
    assert row == 6001 and index.search(vectors[3], 1)[1][0] == row


def test_retraining_keeps_row_numbers_and_fits_drifted_rows_better(vectors: np.ndarray) -> None:
    index = live_index(vectors)
    drifted = GaussianMixture(vectors.shape[1], num_clusters=40, seed=9).sample(3000)
    rows = index.apply_changes(
        [f"n{i}" for i in range(3000)], drifted, ["t"] * 3000, retired=list(range(1000))
    )
    searcher = index.searcher
    assert isinstance(searcher, StagedIVF)
    before = searcher.centroid_distance(drifted).mean()
    assert index.compact(retrain=True) == 1000
    retrained = index.searcher
    assert isinstance(retrained, StagedIVF) and retrained is not searcher and retrained.ntotal == 8000
    assert retrained.centroid_distance(drifted).mean() < before
    assert index.search(drifted[5], 1)[1][0] == rows[5] and index.search(vectors[2000], 1)[1][0] == 2000
    assert 10 not in index.search(vectors[10], 5)[1].tolist()


def test_retraining_needs_flat_lists(vectors: np.ndarray) -> None:
    index = VectorIndex(StagedIVF.build(vectors, nlist=64, codes="sq8"), [f"p{i}" for i in range(6000)])
    with pytest.raises(InvalidInputError, match="flat lists"):
        index.compact(retrain=True)
