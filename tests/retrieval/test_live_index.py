"""A live index: rows appended and hidden while it serves, in every stage and both channels,
on an IVF index (lists) and an HNSW index (graph)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from specrag.errors import InvalidInputError
from specrag.retrieval.backends.local.staged_hnsw import StagedHNSW
from specrag.retrieval.backends.local.staged_ivf import StagedIVF
from specrag.retrieval.lexical.bm25 import LexicalIndex
from specrag.retrieval.live_index import Growable, ReadWriteLock, Visibility
from specrag.retrieval.search.stages import StagePlan
from specrag.retrieval.synthetic import GaussianMixture
from specrag.retrieval.vector_index import VectorIndex

TEXTS = [f"passage {i} about topic{i % 40} and theme{i % 7}" for i in range(6000)]
KINDS = ["ivf", "hnsw"]


def live_index(vectors: np.ndarray, lexical: bool = False, kind: str = "ivf") -> VectorIndex:
    """A fresh index per test: a live one changes."""
    searcher = (
        StagedIVF.build(vectors, nlist=64, nprobe=24)
        if kind == "ivf"
        else StagedHNSW.build(vectors, m=16, ef_search=48)
    )
    return VectorIndex(
        searcher,
        [f"p{i}" for i in range(len(vectors))],
        lexical=LexicalIndex.build(TEXTS[: len(vectors)]) if lexical else None,
    )


def every_stage(index: VectorIndex, query: np.ndarray, k: int, text: str | None = None) -> list[list[int]]:
    return [list(index.ranked_rows(stage.ids)) for stage in index.search_staged(query, k, query_text=text)]


@pytest.mark.parametrize("kind", KINDS)
def test_an_added_vector_is_found_in_every_stage_and_a_replaced_one_in_none(
    vectors: np.ndarray, kind: str
) -> None:
    index = live_index(vectors, kind=kind)
    query = vectors[17]
    assert every_stage(index, query, 5)[-1][0] == 17
    (row,) = index.apply_changes(["p17"], vectors[17:18], ["new text"], retired=[17])
    assert row == len(vectors) and index.passage_ids[row] == "p17"
    stages = every_stage(index, query, 5)
    assert all(17 not in stage for stage in stages)
    assert stages[-1][0] == row and all(len(stage) == 5 for stage in stages)
    _, ids = index.search(query, 5)
    assert ids[0] == row and 17 not in ids.tolist() and len(ids) == 5


@pytest.mark.parametrize("kind", KINDS)
def test_hidden_rows_are_never_returned_and_k_visible_rows_remain(
    vectors: np.ndarray, queries: np.ndarray, kind: str
) -> None:
    index = live_index(vectors, kind=kind)
    _, before = index.search(queries[:50], 10, batch=True)
    hidden = sorted(set(before[:, :5].ravel().tolist()))
    index.apply_changes([], np.zeros((0, index.dim), dtype=np.float32), [], retired=hidden)
    assert index.hidden_rows == len(hidden)
    _, after = index.search(queries[:50], 10, batch=True)
    stages = [stage.ids for stage in index.search_staged(queries[:50], 10, batch=True)]
    for ids in [after, *stages]:
        assert not set(ids.ravel().tolist()) & set(hidden)
        assert (ids >= 0).all()  # read deeper, so ten visible rows each


def test_hybrid_search_finds_an_added_documents_new_word_and_drops_deleted_ones(vectors: np.ndarray) -> None:
    index = live_index(vectors, lexical=True)
    query = vectors[3]
    (row,) = index.apply_changes(["new"], vectors[900:901], ["zanzibar quokka fact"], retired=[])
    assert every_stage(index, vectors[900], 5, "zanzibar quokka")[-1][0] == row
    index.apply_changes([], np.zeros((0, index.dim), dtype=np.float32), [], retired=[row, 3])
    for stage in every_stage(index, query, 5, "zanzibar quokka topic3"):
        assert row not in stage and 3 not in stage


@pytest.mark.parametrize("kind", KINDS)
def test_a_search_sees_the_corpus_as_it_was_when_it_started(vectors: np.ndarray, kind: str) -> None:
    index = live_index(vectors, kind=kind)
    search = iter(index.search_staged(vectors[5], 5))
    first = next(search)
    index.apply_changes(["p5"], vectors[5:6], ["v2"], retired=[5])
    rest = list(search)
    assert 5 in first.ids.tolist() + rest[-1].ids.tolist() and len(vectors) not in rest[-1].ids.tolist()
    assert every_stage(index, vectors[5], 5)[-1][0] == len(vectors)


@pytest.mark.parametrize("kind", KINDS)
def test_rows_added_before_their_visibility_map_to_no_passage(
    vectors: np.ndarray, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between the searcher's add and the visibility's swap a search can meet the new rows; on a
    compacted index too, whose searcher holds fewer rows than their numbers reach."""
    index = live_index(vectors, kind=kind)
    index.apply_changes([], vectors[:0], [], retired=[0, 1, 2])
    index.compact()
    searcher = index.searcher
    assert isinstance(searcher, Growable) and searcher.ntotal < len(vectors)
    seen: list[list[int]] = []
    add = searcher.add

    def add_then_search(new: np.ndarray, first_row: int) -> None:
        add(new, first_row)
        seen.append(index.passage_index_of(np.array([5, first_row])).tolist())  # a search in the window

    monkeypatch.setattr(searcher, "add", add_then_search)
    index.apply_changes(["p5"], vectors[5:6], ["v2"], retired=[5])
    assert seen == [[5, -1]]
    with pytest.raises(InvalidInputError, match="outside"):
        index.passage_index_of(np.array([len(vectors) + 1]))


def test_a_padded_index_cannot_grow_and_says_so(vectors: np.ndarray) -> None:
    index = VectorIndex(
        StagedHNSW.build(vectors[:500], m=8, ef_search=16),
        [f"p{i}" for i in range(400)],
        synthetic_sources=np.arange(100),
    )
    with pytest.raises(InvalidInputError, match="padded index"):
        index.apply_changes(["x"], vectors[:1], ["x"], retired=[])
    index.apply_changes([], np.zeros((0, index.dim), dtype=np.float32), [], retired=[7])  # hiding works
    assert 7 not in index.search(vectors[7], 5)[1].tolist()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("hidden", [[], [0, 1, 2]])
def test_adds_while_searches_run_neither_crash_nor_lose_rows(
    vectors: np.ndarray, queries: np.ndarray, hidden: list[int], kind: str
) -> None:
    index = live_index(vectors[:3000], kind=kind)
    index.apply_changes([], np.zeros((0, index.dim), dtype=np.float32), [], retired=hidden)
    errors: list[BaseException] = []
    stop = threading.Event()

    def seen(ids: np.ndarray, rows_since: int) -> None:
        """Only rows of the visibility the search started with: the rows visible by ``rows_since``
        read after it started (at least as many), none hidden."""
        assert ids.shape == (8, 5) and ids.max() < rows_since and not set(ids.ravel().tolist()) & set(hidden)
        index.ranked_rows(ids[0])

    def search() -> None:
        try:
            while not stop.is_set():
                staged = iter(index.search_staged(queries[:8], 5, batch=True))
                first = next(staged)
                rows_since = len(index.visible_rows)
                for stage in [first, *staged]:
                    seen(stage.ids, rows_since)
                one_shot = index.search(queries[:8], 5, batch=True)[1]
                seen(one_shot, len(index.visible_rows))
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=search) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        for start in range(3000, 3400, 20):
            index.apply_changes(
                [f"n{start + i}" for i in range(20)], vectors[start : start + 20], ["t"] * 20, []
            )
    finally:  # a refused add must not leave the searches running
        stop.set()
        for thread in threads:
            thread.join()
    assert not errors and index.searcher.ntotal == 3400
    assert index.search(vectors[3399], 1)[1][0] == 3399
    assert every_stage(index, vectors[3333], 1)[-1] == [3333]


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


def compacted_top10(index: VectorIndex, vectors: np.ndarray, queries: np.ndarray) -> tuple[list, list]:
    """Hide every third row (row 1 added anew as row 6000) and compact: the top-10 rows of
    ``queries`` before and after; then check a document added afterwards continues the row numbers."""
    index.apply_changes(["p1"], vectors[1:2], ["t"], retired=list(range(0, 6000, 3)))
    assert index.removable_rows == 2000
    before = [index.search(query, 10)[1].tolist() for query in queries]
    old = index.searcher
    assert index.compact() == 2000
    assert index.searcher is not old and index.searcher.ntotal == 4001 and index.removable_rows == 0
    after = [index.search(query, 10)[1].tolist() for query in queries]
    (row,) = index.apply_changes(["p3"], vectors[3:4], ["t"], retired=[])
    assert (
        row == 6001
        and index.search(vectors[3], 1)[1][0] == row
        and every_stage(index, vectors[3], 1)[-1] == [row]
    )
    return before, after


@pytest.mark.parametrize("codes", ["flat", "sq8"])
def test_compaction_drops_hidden_rows_and_changes_no_result(
    vectors: np.ndarray, queries: np.ndarray, codes: str
) -> None:
    index = VectorIndex(
        StagedIVF.build(vectors, nlist=64, nprobe=24, codes=codes), [f"p{i}" for i in range(6000)]
    )
    before, after = compacted_top10(index, vectors, queries[:40])
    assert after == before


def test_a_compacted_graph_keeps_row_numbers_and_finds_what_it_found(
    vectors: np.ndarray, queries: np.ndarray
) -> None:
    index = live_index(vectors, kind="hnsw")
    before, after = compacted_top10(index, vectors, queries[:40])
    similarity = queries[:40] @ np.concatenate([vectors, vectors[1:2]]).T  # row 6000 is row 1 again
    similarity[:, 0:6000:3] = -np.inf
    exact = np.argsort(-similarity, axis=1)[:, :10].tolist()

    def hits(found: list[list[int]]) -> float:
        """How many of its true top-10 a query finds, on average."""
        return float(np.mean([len(set(rows) & set(best)) for rows, best in zip(found, exact, strict=True)]))

    assert hits(after) >= 9 and hits(after) >= hits(before) - 0.2  # a new graph, as good a one
    assert all(
        every_stage(index, query, 10)[-1] == list(index.ranked_rows(index.search(query, 10)[1]))
        for query in queries[:40]
    )
    assert index.search(vectors[2], 1)[1][0] == 2 and 9 not in index.search(vectors[9], 5)[1].tolist()
    with pytest.raises(InvalidInputError, match="no centroids"):
        index.compact(retrain=True)


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


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("compacted", [False, True])
def test_hidden_rows_are_skipped_at_the_source_and_the_last_stage_is_the_one_shot_search(
    vectors: np.ndarray, queries: np.ndarray, kind: str, compacted: bool
) -> None:
    """Half the rows hidden (on a compacted graph, its positions are not its rows): the searcher
    itself returns k visible rows, each stage's search and the one-shot search the same ones."""
    index = live_index(vectors, kind=kind)
    if compacted:
        index.apply_changes([], vectors[:0], [], retired=list(range(0, 6000, 7)))
        index.compact()
    index.apply_changes([], vectors[:0], [], retired=list(range(1, 6000, 2)))
    visibility = index.visibility
    searcher = index.searcher
    assert isinstance(searcher, Growable)
    _, ids = searcher.search(queries[:50], 10, visibility)
    last = list(searcher.stages(queries[:50], 10, StagePlan(4, "equal"), visibility))[-1]
    np.testing.assert_array_equal(last.ids, ids)
    assert (ids >= 0).all() and visibility.visible[ids].all()
