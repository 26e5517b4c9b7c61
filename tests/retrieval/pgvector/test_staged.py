"""Staged search on a real server: stages nest, the final one is the one-shot, one snapshot."""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import psycopg
import pytest
from psycopg.pq import Trace

from specrag.errors import InvalidInputError
from specrag.retrieval.backends.pgvector.config import PgSettings, StageMode, StageQueries
from specrag.retrieval.backends.pgvector.database import Database
from specrag.retrieval.backends.pgvector.deadline import Deadline
from specrag.retrieval.backends.pgvector.searcher import PgVectorSearcher, stage_probes
from specrag.retrieval.backends.pgvector.table import inspect_table, load_table, read_passages
from specrag.retrieval.search.stages import StagePlan
from tests.helpers.vectors import DIM, LISTS, PROBES, passages_for

K = 10
PLAN = StagePlan(6, "geometric")


def open_searcher(
    settings: PgSettings, mode: StageMode, queried: StageQueries = StageQueries.ENDS
) -> PgVectorSearcher:
    database = Database(settings)
    layout = inspect_table(database, DIM)
    ids = [passage.id for passage in read_passages(database)]
    return PgVectorSearcher(database, layout, ids, nprobe=PROBES, mode=mode, queried=queried)


@pytest.fixture(params=list(itertools.product(StageMode, StageQueries)), ids="-".join)
def searcher(request: pytest.FixtureRequest, pg_table: PgSettings) -> Iterator[PgVectorSearcher]:
    opened = open_searcher(pg_table, *request.param)
    yield opened
    opened.close()


def test_the_stage_probes_grow_to_the_final_count() -> None:
    assert stage_probes(PLAN, PROBES, StageQueries.EVERY) == [1, 3, 6, 12, 24]
    assert stage_probes(StagePlan(3, "equal"), 1, StageQueries.EVERY) == [1]
    assert stage_probes(StagePlan.budget(0.01), 64, StageQueries.EVERY)[-1] == 64


def test_by_default_only_the_first_and_the_final_stage_are_queried() -> None:
    assert stage_probes(PLAN, PROBES) == [1, 24]
    assert stage_probes(StagePlan(3, "equal"), 1) == [1]


def test_the_table_reads_back_as_built(pg_table: PgSettings) -> None:
    database = Database(pg_table)
    try:
        layout = inspect_table(database, DIM)
        assert (layout.dim, layout.metric, layout.lists) == (DIM, "ip", LISTS)
    finally:
        database.close()


def test_each_stage_refines_the_last_and_the_final_is_the_one_shot(
    searcher: PgVectorSearcher, pg_queries: np.ndarray, vectors: np.ndarray
) -> None:
    finals_differ_from_first = 0
    for query in pg_queries:
        one_shot_scores, one_shot_ids = searcher.search(query[None, :], K)
        stages = list(searcher.stages(query[None, :], K, PLAN))
        assert stages[-1].done and not any(stage.done for stage in stages[:-1])
        assert [stage.stage for stage in stages] == sorted({stage.stage for stage in stages})
        np.testing.assert_array_equal(stages[-1].ids, one_shot_ids)
        np.testing.assert_allclose(stages[-1].distances, one_shot_scores, rtol=1e-6)
        for before, after in itertools.pairwise(stages):
            # A superset of rows scanned: the i-th best can only get better.
            assert (after.distances >= before.distances - 1e-6).all()
        # The scores are the inner products of the rows returned, best first.
        row_ids = one_shot_ids[0]
        np.testing.assert_allclose(one_shot_scores[0], vectors[row_ids] @ query, rtol=1e-4, atol=1e-5)
        finals_differ_from_first += not np.array_equal(stages[0].ids, stages[-1].ids)
    if searcher.mode is StageMode.SEQUENTIAL:
        # Every stage arrives; the early ones are not all final already (else nothing is tested).
        assert finals_differ_from_first > 0


def test_a_batch_stages_every_query(searcher: PgVectorSearcher, pg_queries: np.ndarray) -> None:
    _, ids = searcher.search(pg_queries[:5], K)
    final = list(searcher.stages(pg_queries[:5], K, PLAN))[-1]
    assert final.ids.shape == (5, K)
    np.testing.assert_array_equal(final.ids, ids)


@pytest.fixture
def writable(postgres: object, pg_table: PgSettings, vectors: np.ndarray) -> PgSettings:
    settings = PgSettings(pg_table.dsn, table="staged_written")
    load_table(settings, passages_for(vectors), vectors, nlist=LISTS, replace=True)
    return settings


@pytest.mark.parametrize("mode", list(StageMode), ids=str)
def test_all_stages_read_one_snapshot_while_a_writer_commits(
    writable: PgSettings, pg_queries: np.ndarray, mode: StageMode
) -> None:
    searcher = open_searcher(writable, mode)
    try:
        query = pg_queries[0][None, :]
        _, before = searcher.search(query, K)
        best = f"p{int(before[0, 0]):05d}"
        stages = searcher.stages(query, K, PLAN)
        seen = [next(stages)]
        # Another application deletes the best row and commits while the search runs.
        with psycopg.connect(writable.dsn, autocommit=True) as writer:
            writer.execute(f"DELETE FROM {writable.table} WHERE id = %s", (best,))
        seen += list(stages)
        assert seen[-1].done
        np.testing.assert_array_equal(seen[-1].ids, before)  # the search's snapshot still holds it
        _, after = searcher.search(query, K)
        assert int(before[0, 0]) not in after[0].tolist()  # the next search sees the delete
    finally:
        searcher.close()


@pytest.fixture
def round_trips(searcher: PgVectorSearcher, tmp_path: Path) -> Iterator[list[int]]:
    """The round trips (client ``Sync`` or simple ``Query`` messages: one a pipeline or a statement)
    of each connection
    the searcher takes from its pool, in the order taken, read from libpq's protocol trace."""
    counted: list[int] = []
    taken = searcher.database.connection

    @contextlib.contextmanager
    def traced(deadline: Deadline | None = None) -> Iterator[psycopg.Connection]:
        with taken(deadline) as connection:
            slot = len(counted)
            counted.append(0)  # 0 until the connection goes back
            trace = tmp_path / f"trace-{slot}"
            with trace.open("w") as sink:
                connection.pgconn.trace(sink.fileno())
                connection.pgconn.set_trace_flags(Trace.SUPPRESS_TIMESTAMPS)
                try:
                    yield connection
                finally:
                    connection.pgconn.untrace()
            counted[slot] = sum(
                line.split("\t")[:3:2] in (["F", "Sync"], ["F", "Query"])
                for line in trace.read_text().splitlines()
            )

    searcher.database.connection = traced  # type: ignore[method-assign]
    yield counted
    searcher.database.connection = taken  # type: ignore[method-assign]


def test_a_one_shot_query_is_one_round_trip(
    searcher: PgVectorSearcher, round_trips: list[int], pg_queries: np.ndarray
) -> None:
    searcher.search(pg_queries[:2], K)
    assert round_trips == [1]


def test_the_final_stage_costs_one_round_trip(
    searcher: PgVectorSearcher, round_trips: list[int], pg_queries: np.ndarray
) -> None:
    stages = list(searcher.stages(pg_queries[:1], K, PLAN))
    # Both modes: a round trip a stage, the opening in the first stage's and the COMMIT in the
    # last one's; parallel: the earlier stages' connection also exports (one) and ends (one).
    if searcher.mode is StageMode.SEQUENTIAL:
        assert round_trips == [len(stages)]
    else:
        deadline = time.monotonic() + 5  # the earlier stages' connection is returned after the final
        while not all(round_trips) and time.monotonic() < deadline:
            time.sleep(0.01)
        earlier, final = sorted(round_trips, reverse=True)
        assert final == 1
        # The earlier stages stop once the final one has arrived (stale by then): how many of
        # them ran depends on timing (a loaded machine ran 2 of 4), never more than all of them.
        assert 2 <= earlier <= len(stage_probes(PLAN, PROBES, searcher.queried)) - 1 + 2


@pytest.fixture(scope="module")
def hnsw_table(postgres: object, pg_table: PgSettings, vectors: np.ndarray) -> PgSettings:
    settings = PgSettings(pg_table.dsn, table="staged_hnsw")
    load_table(settings, passages_for(vectors), vectors, replace=True, index_method="hnsw")
    return settings


@pytest.mark.parametrize("mode", list(StageMode), ids=str)
def test_an_hnsw_table_is_staged_by_ef_search_and_its_final_is_the_one_shot(
    hnsw_table: PgSettings, pg_queries: np.ndarray, mode: StageMode
) -> None:
    database = Database(hnsw_table)
    layout = inspect_table(database, DIM)
    assert (layout.method, layout.lists) == ("hnsw", 0)
    ids = [passage.id for passage in read_passages(database)]
    searcher = PgVectorSearcher(database, layout, ids, nprobe=64, mode=mode, queried=StageQueries.EVERY)
    try:
        assert searcher.settings["index"] == "hnsw"
        for query in pg_queries[:10]:
            _, one_shot = searcher.search(query[None, :], K)
            stages = list(searcher.stages(query[None, :], K, PLAN))
            assert stages[-1].done and (stages[-1].ids >= 0).all()  # ef_search never under k
            np.testing.assert_array_equal(stages[-1].ids, one_shot)
    finally:
        searcher.close()


def test_the_index_asked_for_must_be_the_tables(hnsw_table: PgSettings, pg_table: PgSettings) -> None:
    for settings, method in ((hnsw_table, "ivfflat"), (pg_table, "hnsw")):
        database = Database(settings)
        try:
            with pytest.raises(InvalidInputError, match=f"'embedding'.*no {method} index"):
                inspect_table(database, DIM, method=method)
        finally:
            database.close()
