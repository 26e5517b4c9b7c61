"""The document log's file: its schema, what one row holds, and the checksum each row carries.

The live store (:mod:`specrag.pipeline.store.live_store`) logs every change as one row of a SQLite
file in WAL mode with ``synchronous=FULL`` and ``secure_delete``; this module is that file's
format in one place, so that the store's memory (what it serves) and the checkpoint at start
(:mod:`specrag.pipeline.store.live_checkpoint`) read and write rows the same way. Opening the log
checks what it was written over (the base store's corpus, tokenizer and segment template), gives
a log of the first schema its checksums, and refuses another tokenizer's log that holds changes.
Each row's checksum is the base store's row digest (:func:`~specrag.pipeline.store.checksums.row_checksum`)
over the version, tokens and vector, so a damaged row is an error, never a wrong prompt.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from specrag.errors import ArtifactError
from specrag.pipeline.store.checksums import row_checksum
from specrag.pipeline.store.document_store import StoreInfo
from specrag.retrieval.corpus import Passage

__all__ = [
    "COLUMNS",
    "INSERT",
    "LOG_SCHEMA_VERSION",
    "TOKEN_DTYPE",
    "VECTOR_DTYPE",
    "Change",
    "check_other_logs",
    "live_log_path",
    "log_meta",
    "open_log",
    "record_of",
    "truncate_wal",
    "verified_change",
]

logger = logging.getLogger(__name__)

# 2: checksummed rows, one row per id (history purged), the embedder recorded.
LOG_SCHEMA_VERSION = "2"
TOKEN_DTYPE = np.dtype("<u4")
VECTOR_DTYPE = np.dtype("<f4")
_BASE_META = ("schema_version", "corpus_checksum", "tokenizer_fingerprint", "segment_template")
_CREATE_CHANGES = """
    CREATE TABLE IF NOT EXISTS changes (
        seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL, version INTEGER NOT NULL,
        row INTEGER, title TEXT, text TEXT, tokens BLOB, vector BLOB, checksum BLOB NOT NULL)
"""
COLUMNS = "seq, id, version, row, title, text, tokens, vector, checksum"
INSERT = (
    "INSERT INTO changes (id, version, row, title, text, tokens, vector, checksum) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
)


def live_log_path(store_path: Path) -> Path:
    """Where the changes to the store at ``store_path`` are logged (beside it, one per base store)."""
    return store_path.with_name(f"{store_path.stem}.live.sqlite")


@dataclass(frozen=True)
class Change:
    """One logged change: a document's new version (a row, its passage, prompt tokens and vector)
    or its deletion (no row)."""

    id: str
    version: int
    row: int | None = None
    passage: Passage | None = None
    tokens: tuple[int, ...] = ()
    vector: np.ndarray | None = None


def _checksum(
    passage_id: str, version: int, row: int | None, title: str, text: str, tokens: bytes, vector: bytes
) -> bytes:
    """The base store's row digest over a log row: the version, tokens and vector are its payload,
    each length-prefixed (a tombstone has row -1 and an empty payload but its version)."""
    payload = b"".join((version.to_bytes(8, "little"), len(tokens).to_bytes(8, "little"), tokens, vector))
    return row_checksum(-1 if row is None else row, passage_id, title, text, payload)


def record_of(change: Change) -> tuple[Any, ...]:
    """The log row of ``change`` (the columns of :data:`INSERT`)."""
    passage = change.passage
    title, text = ("", "") if passage is None else (passage.title, passage.text)
    tokens = b"" if change.row is None else np.asarray(change.tokens, dtype=TOKEN_DTYPE).tobytes()
    vector = b"" if change.vector is None else np.asarray(change.vector, dtype=VECTOR_DTYPE).tobytes()
    checksum = _checksum(change.id, change.version, change.row, title, text, tokens, vector)
    if change.row is None:
        return (change.id, change.version, None, None, None, None, None, checksum)
    return (change.id, change.version, change.row, title, text, tokens, vector, checksum)


def verified_change(log_path: Path, found: tuple[Any, ...]) -> Change:
    """The change a log row (the columns of :data:`COLUMNS`) holds, checked against its checksum first."""
    seq, passage_id, version, row, title, text, tokens, vector, checksum = found
    try:
        intact = checksum == _checksum(
            passage_id, version, row, title or "", text or "", tokens or b"", vector or b""
        )
    except (TypeError, AttributeError, OverflowError):  # a field of the wrong type
        intact = False
    if not intact or (row is not None and (title is None or text is None or not tokens or not vector)):
        raise ArtifactError(
            f"the document log {log_path}: change {seq} (document {passage_id!r}, version "
            f"{version}) does not match its checksum (the file is damaged); restore the log from a "
            "backup, or move it aside to serve the built corpus without its changes"
        )
    return _change_of(passage_id, version, row, title, text, tokens, vector)


def open_log(log_path: Path, info: StoreInfo) -> sqlite3.Connection:
    """The log at ``log_path`` opened for writing, of the current schema, checked to be written over
    the base store ``info`` describes (an empty log over another base starts anew)."""
    try:
        log = sqlite3.connect(log_path, check_same_thread=False, isolation_level=None)
    except sqlite3.DatabaseError as error:
        raise ArtifactError(f"the document log {log_path} is unreadable: {error}") from error
    try:
        log.execute("PRAGMA journal_mode=WAL")
        log.execute("PRAGMA synchronous=FULL")
        log.execute("PRAGMA secure_delete=ON")  # a purged row's bytes are zeroed, not just freed
        log.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        if log_meta(log).get("schema_version") == "1":
            _migrate_v1(log, log_path)
        log.execute(_CREATE_CHANGES)
        log.execute("CREATE INDEX IF NOT EXISTS changes_by_id ON changes (id)")
        _check_meta(log, log_path, info)
    except sqlite3.DatabaseError as error:
        log.close()
        raise ArtifactError(f"the document log {log_path} is unreadable: {error}") from error
    except BaseException:
        log.close()
        raise
    return log


def log_meta(log: sqlite3.Connection) -> dict[str, str]:
    """What the log records about itself: its schema, its base, the embedder of its vectors."""
    return dict(log.execute("SELECT key, value FROM meta").fetchall())


def _migrate_v1(log: sqlite3.Connection, log_path: Path) -> None:
    """Give a log of the first schema (unchecked rows, every version kept) its checksums: the
    next checkpoint then drops its history."""
    found = log.execute(
        "SELECT seq, id, version, row, title, text, tokens, vector FROM changes ORDER BY seq"
    ).fetchall()
    log.execute("BEGIN IMMEDIATE")
    try:
        log.execute("DROP TABLE changes")
        log.execute(_CREATE_CHANGES)
        log.executemany(
            "INSERT INTO changes VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [
                (seq, *record_of(_change_of(passage_id, version, row, title, text, tokens, vector)))
                for seq, passage_id, version, row, title, text, tokens, vector in found
            ],
        )
        log.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (LOG_SCHEMA_VERSION,))
        log.execute("COMMIT")
    except BaseException:
        log.execute("ROLLBACK")
        raise
    logger.info("the document log %s: %d changes given checksums (schema 2)", log_path, len(found))


def _check_meta(log: sqlite3.Connection, log_path: Path, info: StoreInfo) -> None:
    """Record what the log's changes apply to, or refuse a log written over another base."""
    expected = {
        "schema_version": LOG_SCHEMA_VERSION,
        "corpus_checksum": info.corpus_checksum,
        "tokenizer_fingerprint": info.tokenizer_fingerprint,
        "segment_template": info.segment_template,
    }
    found = log_meta(log)
    if all(found.get(key) == expected[key] for key in _BASE_META):
        return
    (changes,) = log.execute("SELECT count(*) FROM changes").fetchone()
    if not changes:  # nothing logged over the old base (a corpus rebuilt on purpose): start anew
        log.execute("BEGIN IMMEDIATE")
        log.execute("DELETE FROM meta")
        log.executemany("INSERT INTO meta VALUES (?, ?)", expected.items())
        log.execute("COMMIT")
        return
    different = sorted(key for key in expected if found.get(key) != expected[key])
    raise ArtifactError(
        f"the document log {log_path} holds {changes} changes written over another base store "
        f"({', '.join(different)} differ): move it aside to serve the rebuilt corpus without them"
    )


def check_other_logs(log_path: Path) -> None:
    """Refuse to serve while another tokenizer's log beside this one holds changes: the store,
    and so its log, is per tokenizer, and a ``--model`` switch would hide them silently."""
    for other in sorted(log_path.parent.glob("*.live.sqlite")):
        if other.resolve() == log_path.resolve():
            continue
        try:
            with contextlib.closing(sqlite3.connect(f"file:{other}?mode=ro", uri=True)) as connection:
                (changes,) = connection.execute("SELECT count(*) FROM changes").fetchone()
        except sqlite3.DatabaseError as error:
            changes = f"an unreadable number of ({error})"
        if changes:
            raise ArtifactError(
                f"the documents changed live in {other.parent} are in {other} ({changes} changes), "
                f"the log of another model's tokenizer: serving this model (its log {log_path}) "
                "would hide them. Serve with the model that wrote them (--model), or move that log "
                "aside to serve the built corpus without its changes"
            )


def truncate_wal(log: sqlite3.Connection, log_path: Path) -> None:
    """Copy the WAL into the log and empty it: the superseded rows' old pages leave the disk."""
    try:
        log.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    except sqlite3.Error as error:  # the commit is durable: a later truncation does it
        logger.warning("could not truncate the WAL of %s: %s", log_path, error)


def _change_of(
    passage_id: str,
    version: int,
    row: int | None,
    title: str | None,
    text: str | None,
    tokens: bytes | None,
    vector: bytes | None,
) -> Change:
    if row is None:
        return Change(passage_id, version)
    return Change(
        passage_id,
        version,
        row,
        Passage(passage_id, title or "", text or ""),
        tuple(int(token) for token in np.frombuffer(tokens or b"", dtype=TOKEN_DTYPE)),
        np.frombuffer(vector or b"", dtype=VECTOR_DTYPE),
    )
