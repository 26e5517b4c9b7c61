"""A bounded pool of connections to the server, and the one place its failures become messages.

Every connection the pool opens gets the statement timeout and pgvector's type, and is checked
when it is handed out, so a server killed and restarted costs the queries in flight, not the
ones after it: a dead connection is replaced instead of failing the next query. A failure is
raised as :class:`DatabaseUnavailableError` (an ``EngineUnavailableError``: HTTP 503 with
``Retry-After``), naming the server by host and never the password.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import psycopg
from pgvector.psycopg import register_vector
from psycopg_pool import ConnectionPool, PoolTimeout

from specrag.errors import EngineUnavailableError, InvalidInputError
from specrag.retrieval.pgvector.config import PgSettings, describe_dsn, scrub

__all__ = ["Database", "DatabaseUnavailableError", "connect_once"]


class DatabaseUnavailableError(EngineUnavailableError):
    """The database did not answer (down, unreachable, too slow): retry later (HTTP 503)."""


class Database:
    """The pool of connections to one server, opened at once (so a bad DSN fails at start)."""

    def __init__(self, settings: PgSettings, open_timeout_s: float = 10.0) -> None:
        self.settings = settings
        self._pool = ConnectionPool(
            settings.dsn,
            min_size=1,
            max_size=settings.pool_size,
            kwargs={"autocommit": True},
            configure=self._configure,
            check=ConnectionPool.check_connection,
            # A search waits this long for a connection at most, then the service answers 503.
            timeout=settings.statement_timeout_s,
            reconnect_timeout=24 * 3600,  # keep trying while the server is down: it may come back
            name="specrag-pgvector",
            open=False,
        )
        try:
            self._pool.open(wait=True, timeout=open_timeout_s)
        except PoolTimeout:
            # The pool's reason is in its log; try once by hand for the server's own answer.
            reason = _reason_from_connect(settings)
            self._pool.close()
            raise DatabaseUnavailableError(
                f"cannot connect to {describe_dsn(settings.dsn)}: {reason}"
            ) from None

    def _configure(self, connection: psycopg.Connection) -> None:
        milliseconds = int(self.settings.statement_timeout_s * 1000)
        connection.execute(f"SET statement_timeout = {milliseconds}")
        register_vector(connection)

    @contextlib.contextmanager
    def connection(self) -> Iterator[psycopg.Connection]:
        """A connection from the pool; the driver's failures come out as
        :class:`DatabaseUnavailableError` naming the server (a statement timeout too)."""
        with self.translated(), self._pool.connection() as connection:
            yield connection

    @contextlib.contextmanager
    def translated(self) -> Iterator[None]:
        """Re-raise the driver's failures as specrag's, without the password."""
        where = describe_dsn(self.settings.dsn)
        try:
            yield
        except PoolTimeout:
            raise DatabaseUnavailableError(
                f"no connection to {where} within {self.settings.statement_timeout_s:g}s "
                "(the server is down or all connections are busy)"
            ) from None
        except psycopg.errors.QueryCanceled:
            raise DatabaseUnavailableError(
                f"a query on {where} ran past the statement timeout ({self.settings.statement_timeout_s:g}s)"
            ) from None
        except psycopg.OperationalError as error:
            raise DatabaseUnavailableError(
                f"the database at {where} failed: {scrub(_first_line(error), self.settings.dsn)}"
            ) from None

    def close(self) -> None:
        self._pool.close()


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[-1] if text else type(error).__name__


def _reason_from_connect(settings: PgSettings) -> str:
    try:
        psycopg.connect(settings.dsn, connect_timeout=5).close()
    except psycopg.Error as error:
        return scrub(_first_line(error), settings.dsn)
    return "the pool could not open a connection in time"


def connect_once(settings: PgSettings) -> psycopg.Connection:
    """One connection outside the pool (a table build's), autocommit off, the vector type known;
    a failure names the server, never the password."""
    try:
        connection = psycopg.connect(settings.dsn, connect_timeout=10)
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
