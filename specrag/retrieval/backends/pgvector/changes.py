"""Rows changed in a served pgvector table by other writers, noticed while the service runs.

At start the service installs a trigger on the table (:func:`install_change_trigger`, when it may
alter the table, as it adds the version column): on INSERT and UPDATE it numbers the row's new
version (an UPDATE that leaves :data:`~specrag.retrieval.backends.pgvector.writes.VERSION_COLUMN` as it was
is another writer's, and gets the next version; the documents API's own writes set it), and on
every change it sends ``pg_notify`` on a channel of the table's own (:func:`channel_name`) with the
row's id, version and operation; a deleted row's version is kept, so an INSERT of its id goes
on from it (:func:`install_change_trigger`). A TRUNCATE fires no row trigger: a statement trigger
of its own notifies it, and the listener answers with a full reconcile (below), which hides every row gone.
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

import hashlib
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

from specrag.retrieval.backends.pgvector.config import PgSettings, bounded_conninfo, describe_dsn, scrub
from specrag.retrieval.backends.pgvector.database import Database
from specrag.retrieval.backends.pgvector.deadline import Deadline, Watchdog
from specrag.retrieval.backends.pgvector.table import bulk_read
from specrag.retrieval.backends.pgvector.writes import VERSION_COLUMN

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
KEEP_TRIGGER = "specrag_truncate_keep"
TOMBSTONES = "specrag_tombstones"


def _digest(settings_or_table: PgSettings | str) -> str:
    """A digest of the table's qualified, quoted name: ``A.b``, ``a.b`` and ``a_b`` differ."""
    table = settings_or_table if isinstance(settings_or_table, str) else settings_or_table.table
    quoted = ".".join('"' + part.replace('"', '""') + '"' for part in table.split("."))
    return hashlib.sha256(quoted.encode()).hexdigest()[:16]


def channel_name(table: str) -> str:
    """The NOTIFY channel of ``table``: ``specrag_``, the table's name as far as it is readable,
    and a digest of its qualified name, so no two tables share one (at most 63 bytes, PostgreSQL's
    identifier limit)."""
    readable = re.sub(r"[^a-z0-9_]", "_", table.lower())[:30]
    return f"specrag_{readable}_{_digest(table)}"


def _schema_of(connection: psycopg.Connection, settings: PgSettings) -> str:
    """The schema the table is in (the search path's, for an unqualified name)."""
    found = connection.execute(
        "SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE c.oid = to_regclass(%s)",
        (sql.Identifier(*settings.table_parts).as_string(connection),),
    ).fetchone()
    if found is None:
        raise psycopg.errors.UndefinedTable(f"no table {settings.table}")
    return str(found[0])


def install_change_trigger(database: Database) -> str | None:
    """Install (or replace) the table's change trigger; returns why it could not (changes by other
    writers are then noticed only at the next start), None once installed.

    A version is never given twice to one id: a deleted row's version is kept in a table of
    tombstones beside the table (its id and last version; TRUNCATE keeps every row's), and a row
    inserted again under that id starts after it. The trigger's function runs as its owner (the
    service's user, who owns the tombstones), with every name qualified, so another writer needs
    no rights on the tombstones.
    """
    settings = database.settings
    try:
        with database.connection() as connection, connection.transaction():
            schema = _schema_of(connection, settings)
            table = sql.Identifier(schema, settings.table_parts[-1])
            tombstones = sql.Identifier(schema, f"{TOMBSTONES}_{_digest(settings)}")
            connection.execute(
                sql.SQL(
                    "CREATE TABLE IF NOT EXISTS {} (id text PRIMARY KEY, version bigint NOT NULL)"
                ).format(tombstones)
            )
            function = sql.Identifier(schema, f"{TRIGGER}_{_digest(settings)}")
            body = _trigger_body(settings, table, tombstones).as_string(connection)
            connection.execute(
                sql.SQL(
                    "CREATE OR REPLACE FUNCTION {}() RETURNS trigger LANGUAGE plpgsql SECURITY DEFINER "
                    "SET search_path = pg_catalog, pg_temp AS {}"
                ).format(function, sql.Literal(body))
            )
            names = [sql.Identifier(name) for name in (TRIGGER, TRUNCATE_TRIGGER, KEEP_TRIGGER)]
            for name in names:
                connection.execute(sql.SQL("DROP TRIGGER IF EXISTS {} ON {}").format(name, table))
            row, truncated, kept = names
            connection.execute(
                sql.SQL(
                    "CREATE TRIGGER {} BEFORE INSERT OR UPDATE OR DELETE ON {} "
                    "FOR EACH ROW EXECUTE FUNCTION {}()"
                ).format(row, table, function)
            )
            # A TRUNCATE fires no row trigger: one before it keeps every row's version, one after
            # it notifies, so it is seen at once.
            for when, name in (("BEFORE", kept), ("AFTER", truncated)):
                connection.execute(
                    sql.SQL(
                        "CREATE TRIGGER {} {} TRUNCATE ON {} FOR EACH STATEMENT EXECUTE FUNCTION {}()"
                    ).format(name, sql.SQL(when), table, function)
                )
    except psycopg.errors.InsufficientPrivilege:
        return (
            f"this user may not add a trigger (and its tombstones table) to {settings.table}: rows other "
            "writers change are noticed at the next start only"
        )
    return None


def _trigger_body(settings: PgSettings, table: sql.Identifier, tombstones: sql.Identifier) -> sql.Composed:
    names = {
        "id": sql.Identifier(settings.columns.id),
        "ver": sql.Identifier(VERSION_COLUMN),
        "channel": sql.Literal(channel_name(settings.table)),
        "table": table,
        "tombs": tombstones,
    }
    return sql.SQL(
        """
DECLARE
  gone bigint;
BEGIN
  IF TG_OP = 'TRUNCATE' AND TG_WHEN = 'BEFORE' THEN
    INSERT INTO {tombs} (id, version) SELECT {id}::text, {ver} FROM {table}
      ON CONFLICT (id) DO UPDATE SET version = greatest({tombs}.version, excluded.version);
    RETURN NULL;
  END IF;
  IF TG_OP = 'TRUNCATE' THEN
    PERFORM pg_notify({channel}, json_build_object('op', TG_OP)::text);
    RETURN NULL;
  END IF;
  IF TG_OP = 'DELETE' THEN
    INSERT INTO {tombs} (id, version) VALUES (OLD.{id}::text, OLD.{ver})
      ON CONFLICT (id) DO UPDATE SET version = greatest({tombs}.version, excluded.version);
    PERFORM pg_notify({channel}, json_build_object(
      'id', OLD.{id}::text, 'version', OLD.{ver}, 'op', TG_OP)::text);
    RETURN OLD;
  END IF;
  IF TG_OP = 'INSERT' THEN
    DELETE FROM {tombs} WHERE id = NEW.{id}::text RETURNING version INTO gone;
    IF gone IS NOT NULL AND NEW.{ver} <= gone THEN
      NEW.{ver} := gone + 1;
    END IF;
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


class ChangeListener:
    """A thread that LISTENs for the table's changes and calls ``apply(ids)`` with the ids heard of,
    or ``apply(None)`` (reconcile everything) on each (re)connect; stopped by :meth:`close`."""

    def __init__(self, settings: PgSettings, apply: Callable[[Iterable[str] | None], object]) -> None:
        self.settings = settings
        self._apply = apply
        self._stop = threading.Event()
        self.connected = threading.Event()
        self._watchdog = Watchdog("pg-listener-deadline")
        self.thread = threading.Thread(target=self._run, name="pg-changes", daemon=True)

    def start(self) -> ChangeListener:
        self.thread.start()
        return self

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self.thread.join(timeout_s)
        self._watchdog.close()

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
        with psycopg.connect(bounded_conninfo(self.settings.dsn), autocommit=True) as connection:
            listen = sql.SQL("LISTEN {}").format(sql.Identifier(channel_name(self.settings.table)))
            with self._watchdog.watching(connection, Deadline.after(self.settings.search_timeout_s)):
                connection.execute(listen)
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
    with bulk_read(database) as connection:
        return {str(row[0]): int(row[1]) for row in connection.execute(query)}


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
