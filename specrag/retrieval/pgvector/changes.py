"""Rows changed in a served pgvector table by other writers, noticed while the service runs.

At start the service installs a trigger on the table (:func:`install_change_trigger`, when it may
alter the table, as it adds the version column): on INSERT and UPDATE it numbers the row's new
version (an UPDATE that leaves :data:`~specrag.retrieval.pgvector.writes.VERSION_COLUMN` as it was
is another writer's, and gets the next version; the documents API's own writes set it), and on
every change it sends ``pg_notify`` on a channel named for the table (:func:`channel_name`) with the
row's id, version and operation. A TRUNCATE fires no row trigger: a statement trigger of its own
notifies it, and the listener answers with a full reconcile (below), which hides every row gone.
Notifications go out at COMMIT, so a rolled-back change is never seen.

A :class:`ChangeListener` thread LISTENs on its own connection, waiting at most
:data:`POLL_S` at a time so it stops promptly, and hands the ids it hears of to a callback that
reads their rows and applies them as the documents API applies its own writes (a new passage row
for a new version, the old one hidden). A notification sent while it was disconnected is lost, so
on every (re)connect, the first included, it asks for a full reconcile: every (id, version) in the
table against what the service holds. When the database goes away it reconnects with a backoff
up to :data:`MAX_BACKOFF_S`.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import psycopg
from psycopg import sql

from specrag.retrieval.pgvector.config import PgSettings, describe_dsn, scrub
from specrag.retrieval.pgvector.database import Database
from specrag.retrieval.pgvector.writes import VERSION_COLUMN

__all__ = [
    "MAX_BACKOFF_S",
    "POLL_S",
    "ChangeListener",
    "TableRow",
    "channel_name",
    "install_change_trigger",
    "read_rows_of",
    "read_versions",
]

logger = logging.getLogger(__name__)

POLL_S = 0.5  # the longest the listener waits for a notification before checking whether to stop
MAX_BACKOFF_S = 30.0  # the longest it waits between tries to reconnect
TRIGGER = "specrag_changes"
TRUNCATE_TRIGGER = "specrag_truncate"


def channel_name(table: str) -> str:
    """The NOTIFY channel of ``table`` (``specrag_`` and the table's name, an identifier of at
    most 63 characters)."""
    return ("specrag_" + re.sub(r"[^a-z0-9_]", "_", table.lower()))[:63]


def _function_name(settings: PgSettings) -> sql.Identifier:
    parts = settings.table_parts
    name = f"{TRIGGER}_{parts[-1]}"[:63]
    return sql.Identifier(*parts[:-1], name)


def install_change_trigger(database: Database) -> str | None:
    """Install (or replace) the table's change trigger; returns why it could not (changes by other
    writers are then noticed only at the next start), None once installed."""
    settings = database.settings
    names = {
        "id": sql.Identifier(settings.columns.id),
        "ver": sql.Identifier(VERSION_COLUMN),
        "channel": sql.Literal(channel_name(settings.table)),
    }
    body = sql.SQL(
        """
BEGIN
  IF TG_OP = 'TRUNCATE' THEN
    PERFORM pg_notify({channel}, json_build_object('op', TG_OP)::text);
    RETURN NULL;
  END IF;
  IF TG_OP = 'DELETE' THEN
    PERFORM pg_notify({channel}, json_build_object(
      'id', OLD.{id}::text, 'version', OLD.{ver}, 'op', TG_OP)::text);
    RETURN OLD;
  END IF;
  IF TG_OP = 'UPDATE' AND NEW.{ver} IS NOT DISTINCT FROM OLD.{ver} THEN
    NEW.{ver} := OLD.{ver} + 1;
  END IF;
  PERFORM pg_notify({channel}, json_build_object(
    'id', NEW.{id}::text, 'version', NEW.{ver}, 'op', TG_OP)::text);
  RETURN NEW;
END
"""
    ).format(**names)
    function = _function_name(settings)
    table = sql.Identifier(*settings.table_parts)
    trigger = sql.Identifier(TRIGGER)
    truncated = sql.Identifier(TRUNCATE_TRIGGER)
    try:
        with database.connection() as connection, connection.transaction():
            text = body.as_string(connection)
            connection.execute(
                sql.SQL("CREATE OR REPLACE FUNCTION {}() RETURNS trigger LANGUAGE plpgsql AS {}").format(
                    function, sql.Literal(text)
                )
            )
            for name in (trigger, truncated):
                connection.execute(sql.SQL("DROP TRIGGER IF EXISTS {} ON {}").format(name, table))
            connection.execute(
                sql.SQL(
                    "CREATE TRIGGER {} BEFORE INSERT OR UPDATE OR DELETE ON {} "
                    "FOR EACH ROW EXECUTE FUNCTION {}()"
                ).format(trigger, table, function)
            )
            # A TRUNCATE fires no row trigger: one for the statement, so it is seen at once.
            connection.execute(
                sql.SQL(
                    "CREATE TRIGGER {} AFTER TRUNCATE ON {} FOR EACH STATEMENT EXECUTE FUNCTION {}()"
                ).format(truncated, table, function)
            )
    except psycopg.errors.InsufficientPrivilege:
        return (
            f"this user may not add a trigger to {settings.table}: rows other writers change are "
            "noticed at the next start only"
        )
    return None


class ChangeListener:
    """A thread that LISTENs for the table's changes and calls ``apply(ids)`` with the ids heard of,
    or ``apply(None)`` (reconcile everything) on each (re)connect; stopped by :meth:`close`."""

    def __init__(self, settings: PgSettings, apply: Callable[[Iterable[str] | None], object]) -> None:
        self.settings = settings
        self._apply = apply
        self._stop = threading.Event()
        self.connected = threading.Event()
        self._connection: psycopg.Connection | None = None
        self.thread = threading.Thread(target=self._run, name="pg-changes", daemon=True)

    def start(self) -> ChangeListener:
        self.thread.start()
        return self

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self.thread.join(timeout_s)

    def _run(self) -> None:
        backoff = POLL_S
        while not self._stop.is_set():
            try:
                self._listen()
                backoff = POLL_S
            except Exception as error:  # the database went away, or applying failed: start over
                self.connected.clear()
                logger.warning(
                    "listening for changes to %s on %s failed (%s); retrying in %.1fs",
                    self.settings.table,
                    describe_dsn(self.settings.dsn),
                    scrub(
                        str(error).strip().splitlines()[-1] if str(error).strip() else repr(error),
                        self.settings.dsn,
                    ),
                    backoff,
                )
                logger.debug("the listener's failure", exc_info=True)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF_S)

    def _listen(self) -> None:
        with psycopg.connect(self.settings.dsn, autocommit=True, connect_timeout=10) as connection:
            connection.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel_name(self.settings.table))))
            self._apply(None)  # what changed while nobody listened
            self.connected.set()
            while not self._stop.is_set():
                ids: dict[str, None] = {}
                truncated = False
                for notify in connection.notifies(timeout=POLL_S):
                    try:
                        change = json.loads(notify.payload)
                        if change["op"] == "TRUNCATE":
                            truncated = True
                        else:
                            ids[str(change["id"])] = None
                    except (ValueError, KeyError, TypeError):
                        logger.warning("ignored a malformed change notification: %r", notify.payload[:200])
                    if truncated or len(ids) >= 1000:
                        break
                if truncated:
                    self._apply(None)  # every row went: the reconcile hides them all
                elif ids:
                    self._apply(ids)
                elif connection.closed or connection.broken:
                    raise psycopg.OperationalError("the listening connection closed")


def read_versions(database: Database) -> dict[str, int]:
    """Every row's id (as text) and version, in one statement."""
    settings = database.settings
    query = sql.SQL("SELECT {}::text, {} FROM {}").format(
        sql.Identifier(settings.columns.id),
        sql.Identifier(VERSION_COLUMN),
        sql.Identifier(*settings.table_parts),
    )
    with database.connection() as connection:
        connection.execute("SET statement_timeout = 0")  # a full read: bounded by the table
        try:
            return {str(row[0]): int(row[1]) for row in connection.execute(query)}
        finally:
            connection.execute(f"SET statement_timeout = {int(settings.statement_timeout_s * 1000)}")


def read_rows_of(database: Database, ids: Iterable[str]) -> dict[str, TableRow]:
    """Each of ``ids`` the table holds, read in one statement."""
    wanted = list(ids)
    if not wanted:
        return {}
    settings = database.settings
    columns = settings.columns
    query = sql.SQL(
        "SELECT {id}::text, coalesce({title}::text, ''), coalesce({text}::text, ''), {ver}, {emb} "
        "FROM {table} WHERE {id}::text = ANY(%s)"
    ).format(
        id=sql.Identifier(columns.id),
        title=sql.Identifier(columns.title),
        text=sql.Identifier(columns.text),
        ver=sql.Identifier(VERSION_COLUMN),
        emb=sql.Identifier(columns.embedding),
        table=sql.Identifier(*settings.table_parts),
    )
    with database.connection() as connection:
        return {
            str(found[0]): TableRow(found[1], found[2], int(found[3]), _vector(found[4]))
            for found in connection.execute(query, (wanted,))
        }


def _vector(value: Any) -> np.ndarray | None:
    """pgvector's ``Vector`` (or an array, by the driver's version) as float32, None for NULL."""
    if value is None:
        return None
    return np.asarray(value.to_numpy() if hasattr(value, "to_numpy") else value, dtype=np.float32)


@dataclass(frozen=True)
class TableRow:
    """A row as the table holds it: title, text, version and embedding (None: the row has none)."""

    title: str
    text: str
    version: int
    embedding: np.ndarray | None
