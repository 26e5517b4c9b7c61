"""A bounded pool of connections to the server, and the one place its failures become messages.

Every call the service makes runs under a deadline on the client (:mod:`deadline`): the wait for
a connection, the pool's check of it, the statements and the rollback a failed transaction leaves
(done here, so that the pool's own hand-back costs no round trip). A connection is checked when it
is handed out, so a server killed and restarted costs the queries in flight, not the ones after
it; a connection cut at its deadline is discarded, never lent again. Connections are opened with
libpq's bounds (:data:`~specrag.retrieval.backends.pgvector.config.CONNECTION_BOUNDS`) and the statement
timeout in their options, and copy the vector types read once at start, so opening one costs no
round trip after the handshake.

Every failure of the driver is raised as :class:`~specrag.errors.DatabaseUnavailableError` (HTTP
503 ``database_unavailable``), naming the server by host and never the password: a statement the
server refuses (a table dropped under the service, a snapshot gone) is the database's failure,
not the caller's.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import psycopg
from pgvector.psycopg import register_vector
from psycopg.adapt import AdaptersMap
from psycopg.pq import TransactionStatus
from psycopg.types import TypeInfo
from psycopg_pool import ConnectionPool, PoolTimeout

from specrag.errors import DatabaseUnavailableError, InvalidInputError
from specrag.retrieval.backends.pgvector.config import PgSettings, bounded_conninfo, describe_dsn, scrub
from specrag.retrieval.backends.pgvector.deadline import Deadline, Watchdog

__all__ = ["Database", "DatabaseUnavailableError", "connect_once"]


class Database:
    """The pool of connections to one server, opened at once (so a bad DSN fails at start)."""

    def __init__(self, settings: PgSettings, open_timeout_s: float = 10.0) -> None:
        self.settings = settings
        self.watchdog = Watchdog("pg-deadlines")
        self._calling = threading.local()  # the deadline of the call whose connection the pool checks
        self._lent_lock = threading.Lock()
        self._lent = 0
        conninfo = settings.conninfo
        try:
            types = self._read_types(conninfo, Deadline.after(open_timeout_s))
        except BaseException:
            self.watchdog.close()
            raise
        self._pool = ConnectionPool(
            conninfo,
            min_size=1,
            max_size=settings.pool_size,
            kwargs={"autocommit": True, "context": types},
            check=self._check,
            timeout=settings.search_timeout_s,
            reconnect_timeout=24 * 3600,  # keep trying while the server is down: it may come back
            name="specrag-pgvector",
            open=False,
        )
        try:
            self._pool.open(wait=True, timeout=open_timeout_s)
        except PoolTimeout:
            self.close()
            raise DatabaseUnavailableError(
                f"cannot connect to {describe_dsn(settings.dsn)}: the pool could not open a connection "
                f"within {open_timeout_s:g}s"
            ) from None

    @property
    def lent(self) -> int:
        """Connections handed out and not given back yet."""
        return self._lent

    def _read_types(self, conninfo: str, deadline: Deadline) -> AdaptersMap:
        """pgvector's types, read once on a connection of their own, for every pooled one to copy."""
        where = describe_dsn(self.settings.dsn)
        try:
            connection = psycopg.connect(conninfo, autocommit=True)
        except psycopg.Error as error:
            raise DatabaseUnavailableError(
                f"cannot connect to {where}: {scrub(_first_line(error), self.settings.dsn)}"
            ) from None
        with connection, self.translated(deadline), self.watchdog.watching(connection, deadline):
            if TypeInfo.fetch(connection, "vector") is None:
                raise InvalidInputError(
                    f"the database at {where} has no vector type: CREATE EXTENSION vector (pgvector) there"
                )
            register_vector(connection)
            return AdaptersMap(connection.adapters)

    def _check(self, connection: psycopg.Connection) -> None:
        """The pool's check of a connection it hands out: one empty round trip, within the
        deadline of the call that asked for it."""
        deadline = getattr(self._calling, "deadline", None) or Deadline.after(self.settings.search_timeout_s)
        with self.watchdog.watching(connection, deadline):
            connection.execute("")

    @contextlib.contextmanager
    def connection(self, deadline: Deadline | None = None) -> Iterator[psycopg.Connection]:
        """A connection from the pool for calls that end by ``deadline`` (None: the search
        timeout from now); the driver's failures come out as :class:`DatabaseUnavailableError`
        naming the server (a deadline or a statement timeout passed too)."""
        deadline = deadline or Deadline.after(self.settings.search_timeout_s)
        with self.translated(deadline):
            self._calling.deadline = deadline
            try:
                connection = self._pool.getconn(timeout=max(deadline.left(), 0.001))
            finally:
                self._calling.deadline = None
            with self._lent_lock:
                self._lent += 1
            try:
                with self.watchdog.watching(connection, deadline):
                    try:
                        yield connection
                    finally:
                        _settle(connection)
            finally:
                self._pool.putconn(connection)
                with self._lent_lock:
                    self._lent -= 1

    @contextlib.contextmanager
    def translated(self, deadline: Deadline | None = None) -> Iterator[None]:
        """Re-raise the driver's failures as specrag's, without the password."""
        where = describe_dsn(self.settings.dsn)
        try:
            yield
        except PoolTimeout:
            raise DatabaseUnavailableError(
                f"no connection to {where} within {deadline.seconds if deadline else 0:g}s "
                "(the server is down, silent, or all connections are busy)"
            ) from None
        except psycopg.errors.QueryCanceled:
            raise DatabaseUnavailableError(
                f"a query on {where} ran past the statement timeout ({self.settings.statement_timeout_s:g}s)"
            ) from None
        except psycopg.Error as error:
            if deadline is not None and deadline.passed:
                raise DatabaseUnavailableError(
                    f"the database at {where} gave no answer within {deadline.seconds:g}s: cut off"
                ) from None
            kind = "failed" if isinstance(error, psycopg.OperationalError) else "refused a statement"
            raise DatabaseUnavailableError(
                f"the database at {where} {kind}: {scrub(_first_line(error), self.settings.dsn)}"
            ) from None

    def close(self) -> None:
        if hasattr(self, "_pool"):
            self._pool.close()
        self.watchdog.close()


def _settle(connection: psycopg.Connection) -> None:
    """Leave ``connection`` idle or closed, so that the pool's hand-back costs no round trip
    outside a deadline: a transaction left open (a failed statement's) is rolled back here, under
    the caller's; a connection that cannot be is closed (the pool replaces it)."""
    if connection.broken or connection.closed:
        return
    if connection.info.transaction_status == TransactionStatus.IDLE:
        return
    try:
        connection.rollback()
    except psycopg.Error:
        connection.close()
    if connection.info.transaction_status != TransactionStatus.IDLE:
        connection.close()


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[-1] if text else type(error).__name__


def connect_once(settings: PgSettings) -> psycopg.Connection:
    """One connection outside the pool (a table build's), autocommit off, the vector type known,
    with libpq's bounds (a build's statements take as long as the table needs: no deadline); a
    failure names the server, never the password."""
    try:
        connection = psycopg.connect(bounded_conninfo(settings.dsn))
    except psycopg.Error as error:
        raise DatabaseUnavailableError(
            f"cannot connect to {describe_dsn(settings.dsn)}: {scrub(_first_line(error), settings.dsn)}"
        ) from None
    try:
        connection.execute("CREATE EXTENSION IF NOT EXISTS vector")
        connection.commit()
    except psycopg.Error as error:
        connection.close()
        raise InvalidInputError(
            f"pgvector is not available on {describe_dsn(settings.dsn)}: {_first_line(error)}"
        ) from None
    register_vector(connection)
    return connection
