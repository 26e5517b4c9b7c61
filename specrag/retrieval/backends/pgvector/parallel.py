"""The ``parallel`` stage mode: the earlier stages on one connection, the final one on a second.

The earlier stages run one after the other on one connection, which exports its snapshot (so the
first stage starts at once), and the final query runs on a second connection that imports it (so
it waits only for the export, not for the stages): the final result arrives about when a one-shot
query's would on a table whose query is not dominated by fixed costs (docs/backends.md has the
figures). The final query costs one round trip more than a one-shot query, the export's. A stage
that arrives after the final one is dropped. The full-text ranking goes with the first stage and
with the final one, which may arrive first; both read the one snapshot, so both rank alike.

Both threads work under the search's one deadline, every call of theirs too (:mod:`deadline`):
a silent database cuts them by then, and a search its caller abandons (it stops reading the
stages) tells them to stop at once, so neither holds its connection past the deadline.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future

import numpy as np

from specrag.errors import DatabaseUnavailableError
from specrag.retrieval.backends.pgvector import queries
from specrag.retrieval.backends.pgvector.database import Database
from specrag.retrieval.backends.pgvector.deadline import Deadline
from specrag.retrieval.backends.pgvector.queries import Found, StagedQuery, TableSearch, opening, transaction
from specrag.retrieval.search.stages import StageResult

__all__ = ["parallel_stages"]


def parallel_stages(
    database: Database,
    search: TableSearch,
    threads: Executor,
    query: StagedQuery,
) -> Iterator[tuple[StageResult, np.ndarray | None]]:
    """The stages at ``query.probes`` as they arrive, the final one last (stale earlier ones dropped)."""
    matrix, k, probes, visibility, words = query.matrix, query.k, query.probes, query.visibility, query.words
    deadline = Deadline.after(database.settings.search_timeout_s)
    started = time.perf_counter()
    results: queue.SimpleQueue[tuple[int, Found] | BaseException] = queue.SimpleQueue()
    snapshot: Future[str] = Future()
    imported, stop = threading.Event(), threading.Event()
    final = len(probes) - 1

    def earlier() -> None:
        try:
            with database.connection(deadline) as connection, transaction(connection):
                snapshot.set_result(queries.export(connection))
                for number, count in enumerate(probes[:-1]):
                    if stop.is_set():
                        break
                    ranked = words if number == 0 else None
                    results.put((number, search.run(connection, matrix, k, count, visibility, words=ranked)))
                imported.wait(deadline.left())  # the snapshot lives while this transaction does
        except BaseException as error:
            if not snapshot.done():
                snapshot.set_exception(error)
            results.put(error)

    def lead() -> None:
        try:
            # The connection is taken (and checked) while the other one exports.
            with database.connection(deadline) as connection, transaction(connection):
                statements = opening(connection, _exported(snapshot, deadline, stop))
                found = search.run(connection, matrix, k, probes[final], visibility, statements, True, words)
                imported.set()  # the export's transaction may end: this one has ended too
                results.put((final, found))
        except BaseException as error:
            results.put(error)
        finally:
            imported.set()

    threads.submit(earlier)
    threads.submit(lead)
    return _arrivals(results, final, started, deadline, _stopper(stop, imported))


def _exported(snapshot: Future[str], deadline: Deadline, stop: threading.Event) -> str:
    """The snapshot's name once exported, by the deadline; an abandoned search gives up."""
    while not stop.is_set():
        try:
            return snapshot.result(min(deadline.left(), 0.1))
        except TimeoutError:
            if deadline.passed:
                break
    raise DatabaseUnavailableError(f"the search's snapshot was not exported within {deadline.seconds:g}s")


def _stopper(*events: threading.Event) -> Callable[[], None]:
    def stop() -> None:
        for event in events:
            event.set()

    return stop


def _arrivals(
    results: queue.SimpleQueue[tuple[int, Found] | BaseException],
    final: int,
    started: float,
    deadline: Deadline,
    stop: Callable[[], None],
) -> Iterator[tuple[StageResult, np.ndarray | None]]:
    shown = -1
    try:
        while True:
            try:
                item = results.get(timeout=deadline.left())
            except queue.Empty:
                raise DatabaseUnavailableError(
                    f"a staged search gave no stage within its deadline ({deadline.seconds:g}s)"
                ) from None
            if isinstance(item, BaseException):
                raise item
            number, (scores, ids, lexical) = item
            if number <= shown:
                continue  # an earlier stage that came after a later one: stale already
            now = time.perf_counter()
            yield StageResult(number + 1, ids, scores, number == final, now - started), lexical
            started, shown = now, number
            if number == final:
                return
    finally:
        stop()  # an abandoned search's threads stop at once, and give their connections back
