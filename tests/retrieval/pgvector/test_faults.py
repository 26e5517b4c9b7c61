"""Faults a served table meets, on a real server: a database that goes silent (a Unix-socket
proxy that stops forwarding), searches abandoned while it is, rows the service does not know yet,
a failed snapshot import, a table dropped under the service, names that need quoting, and another
writer's DELETE then INSERT. Every call is bounded on the client, every failure is
:class:`DatabaseUnavailableError` (the service's 503), and the service recovers by itself."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Generator, Iterator
from typing import Any

import numpy as np
import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from specrag.errors import DatabaseUnavailableError
from specrag.retrieval.backends.pgvector import queries as queries_module
from specrag.retrieval.backends.pgvector.changes import channel_name, install_change_trigger
from specrag.retrieval.backends.pgvector.config import PgSettings, StageMode
from specrag.retrieval.backends.pgvector.database import Database
from specrag.retrieval.backends.pgvector.fulltext import check_fulltext
from specrag.retrieval.backends.pgvector.local_server import LocalPostgres
from specrag.retrieval.backends.pgvector.searcher import PgVectorSearcher
from specrag.retrieval.backends.pgvector.table import inspect_table, load_table, read_passages
from specrag.retrieval.backends.pgvector.writes import VERSION_COLUMN, add_version_column
from specrag.retrieval.search.stages import StagePlan, StageResult
from tests.helpers.socket_proxy import StallingProxy
from tests.helpers.vectors import DIM, PROBES, passages_for

K = 5
PLAN = StagePlan(6, "geometric")
SEARCH_TIMEOUT_S = 3.0
# What a test waits at most for an answer that must come (bounded by the search's deadline).
BOUND_S = 30.0


def open_searcher(settings: PgSettings, mode: StageMode = StageMode.SEQUENTIAL) -> PgVectorSearcher:
    database = Database(settings)
    layout = inspect_table(database, DIM)
    ids = [passage.id for passage in read_passages(database)]
    return PgVectorSearcher(database, layout, ids, nprobe=PROBES, mode=mode)


def final(stages: Iterator[StageResult]) -> np.ndarray:
    return [stage for stage in stages if stage.done][-1].ids


def bounded(call: Callable[[], Any], bound_s: float = BOUND_S) -> Any:
    """``call()``'s result or the exception it raised, run in a thread of its own; the test fails
    when it has neither within ``bound_s`` (the thread, a daemon, is left behind)."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            outcome.append(call())
        except BaseException as error:
            outcome.append(error)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(bound_s)
    assert outcome, f"no answer within {bound_s:g}s"
    return outcome[0]


def eventually(check: Callable[[], bool], bound_s: float = BOUND_S) -> None:
    deadline = time.monotonic() + bound_s
    while not check():
        assert time.monotonic() < deadline, "not within the bound"
        time.sleep(0.2)


@pytest.fixture
def proxy(postgres: LocalPostgres) -> Iterator[StallingProxy]:
    with StallingProxy(postgres.root) as opened:
        yield opened


def through(proxy: StallingProxy, table: str) -> PgSettings:
    return PgSettings(
        proxy.dsn, table=table, statement_timeout_s=2.0, pool_size=4, search_timeout_s=SEARCH_TIMEOUT_S
    )


@pytest.mark.parametrize("mode", list(StageMode), ids=str)
def test_a_stalled_database_fails_a_search_by_its_deadline_and_it_recovers(
    proxy: StallingProxy, pg_table: PgSettings, pg_queries: np.ndarray, mode: StageMode
) -> None:
    searcher = open_searcher(through(proxy, pg_table.table), mode)
    try:
        query = pg_queries[:1]
        before = final(searcher.stages(query, K, PLAN))
        proxy.stall()
        started = time.monotonic()
        outcome = bounded(lambda: final(searcher.stages(query, K, PLAN)))
        assert isinstance(outcome, DatabaseUnavailableError), outcome
        assert time.monotonic() - started < SEARCH_TIMEOUT_S + 10  # the deadline, not the bound
        # A search that starts while it is silent is bounded too (a connection checked, not trusted).
        assert isinstance(bounded(lambda: searcher.search(query, K)), DatabaseUnavailableError)
        proxy.resume()

        def answers() -> bool:
            outcome = bounded(lambda: final(searcher.stages(query, K, PLAN)))
            return isinstance(outcome, np.ndarray) and np.array_equal(outcome, before)

        eventually(answers)
    finally:
        searcher.close()


def test_searches_abandoned_on_a_silent_database_give_their_connections_back(
    proxy: StallingProxy, pg_table: PgSettings, pg_queries: np.ndarray
) -> None:
    searcher = open_searcher(through(proxy, pg_table.table), StageMode.PARALLEL)
    database = searcher.database
    try:
        final(searcher.stages(pg_queries[:1], K, PLAN))
        proxy.stall()
        for query in pg_queries[:3]:  # each takes two connections, then its caller leaves
            stages = searcher.stages(query[None, :], K, PLAN)
            assert isinstance(stages, Generator)
            bounded(functools.partial(next, stages))
            stages.close()
        eventually(lambda: database.lent == 0, SEARCH_TIMEOUT_S + 10)
    finally:
        proxy.resume()
        searcher.close()


def test_a_call_past_its_deadline_is_cut_and_its_statement_cancelled(pg_table: PgSettings) -> None:
    """A statement the server would let run (its timeout is longer) is cut at the client's
    deadline, and the cancel request stops it on the server too (a sleep would otherwise go on)."""
    settings = PgSettings(pg_table.dsn, table=pg_table.table, statement_timeout_s=60.0, search_timeout_s=1.0)
    database = Database(settings)

    def sleep() -> None:
        with database.connection() as connection:
            connection.execute("SELECT pg_sleep(30)")

    def sleeping() -> int:
        with psycopg.connect(pg_table.dsn) as connection:
            found = connection.execute(
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE query = 'SELECT pg_sleep(30)' AND state = 'active'"
            ).fetchone()
        return int(found[0]) if found else 0

    try:
        outcome = bounded(sleep)
        assert isinstance(outcome, DatabaseUnavailableError) and "no answer within 1s" in str(outcome)
        eventually(lambda: sleeping() == 0, 10.0)
        assert database.lent == 0
    finally:
        database.close()


def test_connections_carry_keepalives_and_a_user_timeout(pg_table: PgSettings) -> None:
    database = Database(pg_table)
    try:
        with database.connection() as connection:
            options = conninfo_to_dict(connection.info.dsn)
        assert options["keepalives"] == "1" and int(str(options["keepalives_idle"])) > 0
        assert int(str(options["tcp_user_timeout"])) > 0 and int(str(options["connect_timeout"])) > 0
    finally:
        database.close()


def test_rows_the_service_does_not_know_never_shrink_the_top_k(
    pg_table: PgSettings, pg_queries: np.ndarray
) -> None:
    """The rows nearest the query are another writer's, not shown yet: the top-k is the k nearest
    rows the service knows, in every stage and the one-shot search."""
    query = pg_queries[:1]
    known = open_searcher(pg_table)
    try:
        _, nearest = known.search(query, 3 * K)
        ids = [passage.id for passage in read_passages(known.database)]
    finally:
        known.close()
    unknown = {ids[row] for row in nearest[0, : 2 * K]}
    database = Database(pg_table)
    layout = inspect_table(database, DIM)
    partial = PgVectorSearcher(database, layout, [i for i in ids if i not in unknown], nprobe=PROBES)
    try:
        _, found = partial.search(query, K)
        assert (found >= 0).all(), found
        assert all((stage.ids >= 0).all() for stage in partial.stages(query, K, PLAN))
    finally:
        partial.close()


def test_a_failed_snapshot_import_is_a_database_error(
    pg_table: PgSettings, pg_queries: np.ndarray, monkeypatch: pytest.MonkeyPatch
) -> None:
    searcher = open_searcher(pg_table, StageMode.PARALLEL)
    exported = queries_module.export

    def lost(connection: psycopg.Connection) -> str:
        exported(connection)
        return "00000003-0000FFFF-1"  # a snapshot no transaction exports

    monkeypatch.setattr(queries_module, "export", lost)
    try:
        outcome = bounded(lambda: final(searcher.stages(pg_queries[:1], K, PLAN)))
        assert isinstance(outcome, DatabaseUnavailableError), outcome
    finally:
        searcher.close()


def test_a_table_dropped_under_the_service_is_a_database_error(
    postgres: LocalPostgres, vectors: np.ndarray, pg_queries: np.ndarray
) -> None:
    settings = PgSettings(postgres.dsn, table="dropped_later")
    load_table(settings, passages_for(vectors[:500]), vectors[:500], nlist=8, replace=True)
    searcher = open_searcher(settings)
    try:
        with psycopg.connect(postgres.dsn, autocommit=True) as connection:
            connection.execute("DROP TABLE dropped_later")
        with pytest.raises(DatabaseUnavailableError):
            searcher.search(pg_queries[:1], K)
    finally:
        searcher.close()


@pytest.mark.parametrize("table", ["MixedCase", "Spaced.Items"])
def test_a_table_whose_name_needs_quoting_is_served(
    postgres: LocalPostgres, vectors: np.ndarray, pg_queries: np.ndarray, table: str
) -> None:
    with psycopg.connect(postgres.dsn, autocommit=True) as connection:
        connection.execute('CREATE SCHEMA IF NOT EXISTS "Spaced"')
    settings = PgSettings(postgres.dsn, table=table)
    load_table(settings, passages_for(vectors[:500]), vectors[:500], nlist=8, replace=True)
    searcher = open_searcher(settings)
    try:
        check_fulltext(searcher.database)
        assert add_version_column(searcher.database) is None
        assert install_change_trigger(searcher.database) is None
        _, found = searcher.search(pg_queries[:1], K)
        assert (found >= 0).all()
    finally:
        searcher.close()


def test_every_table_has_a_channel_of_its_own() -> None:
    tables = ["A.b", "a_b", "a.b", "Document", "document", "s." + "x" * 63, "t." + "x" * 63]
    channels = [channel_name(table) for table in tables]
    assert len(set(channels)) == len(tables), channels
    assert all(len(channel.encode()) <= 63 for channel in channels)


def test_versions_never_repeat_after_another_writers_delete_and_insert(
    postgres: LocalPostgres, vectors: np.ndarray
) -> None:
    settings = PgSettings(postgres.dsn, table="versions_kept")
    load_table(settings, passages_for(vectors[:50]), vectors[:50], nlist=4, replace=True)
    database = Database(settings)
    try:
        assert add_version_column(database) is None and install_change_trigger(database) is None
    finally:
        database.close()
    version = f"SELECT {VERSION_COLUMN} FROM versions_kept WHERE id = %s"
    insert = (
        "INSERT INTO versions_kept (id, title, text, embedding) "
        "SELECT %s, 'again', 'again', embedding FROM versions_kept WHERE id = 'p00040'"
    )
    with psycopg.connect(postgres.dsn, autocommit=True) as connection:
        connection.execute("UPDATE versions_kept SET text = 'changed' WHERE id = 'p00001'")
        seen = [int(connection.execute(version, ("p00001",)).fetchone()[0])]  # type: ignore[index]
        for _ in range(2):
            with connection.transaction():  # one transaction, as an upsert by hand would
                connection.execute("DELETE FROM versions_kept WHERE id = 'p00001'")
                connection.execute(insert, ("p00001",))
            seen.append(int(connection.execute(version, ("p00001",)).fetchone()[0]))  # type: ignore[index]
        connection.execute("DELETE FROM versions_kept WHERE id = 'p00001'")  # and apart
        connection.execute(insert, ("p00001",))
        seen.append(int(connection.execute(version, ("p00001",)).fetchone()[0]))  # type: ignore[index]
        connection.execute("TRUNCATE versions_kept")
        connection.execute("INSERT INTO versions_kept (id, title, text) VALUES ('p00001', 'again', 'again')")
        seen.append(int(connection.execute(version, ("p00001",)).fetchone()[0]))  # type: ignore[index]
    assert seen == sorted(set(seen)) and seen[0] == 2, seen
