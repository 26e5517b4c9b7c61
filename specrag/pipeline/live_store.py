"""The live layer of the document store: documents added, replaced and deleted while serving.

The built store stays the base, untouched. Every change after it is one row of a SQLite log in WAL
mode with ``synchronous=FULL``, so a committed change is on disk (the WAL fsynced) before the call
returns: the service answers a write only after that commit, and a ``kill -9`` at any moment
loses no acknowledged change. At start the log is replayed (:meth:`LiveStore.logged`) onto the
loaded base: its own rows here, its vectors and texts onto the index
(:mod:`specrag.pipeline.live_corpus`), without tokenizing or embedding anything again.

A new or replaced document gets a new row, appended after the base's and every earlier change's,
and rows never change: a row names exactly one version of one document. Everything keyed by row
(the knowledge tree through the row label in each segment, batch plans, conversations) or by a
segment's tokens (the document-KV store) therefore never mistakes one version for another.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specrag.errors import ArtifactError, ConflictError, InvalidInputError, NotFoundError
from specrag.pipeline.store import DocumentStore
from specrag.retrieval.corpus import Passage

__all__ = ["BASE_VERSION", "LOG_SCHEMA_VERSION", "Change", "LiveStore", "Version", "live_log_path"]

LOG_SCHEMA_VERSION = "1"
# Every document of the built corpus is version 1; each change to an id counts on from there.
BASE_VERSION = 1
_TOKEN_DTYPE = np.dtype("<u4")
_VECTOR_DTYPE = np.dtype("<f4")


def live_log_path(store_path: Path) -> Path:
    """Where the changes to the store at ``store_path`` are logged (beside it, one per base store)."""
    return store_path.with_name(f"{store_path.stem}.live.sqlite")


@dataclass(frozen=True)
class Version:
    """Where an id stands: its current row (None once deleted) and version."""

    row: int | None
    version: int


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


@dataclass(frozen=True)
class _LiveRow:
    passage: Passage
    tokens: tuple[int, ...]
    version: int


class LiveStore(DocumentStore):
    """A built store and its log of changes, read as one store: rows past the base are the log's.

    Reads are safe from any thread; writes (:meth:`commit`) come from one writer at a time (the
    live corpus holds its lock around them).
    """

    def __init__(self, path: Path, log_path: Path | None = None) -> None:
        super().__init__(path)
        self.log_path = log_path or live_log_path(path)
        self._base_rows = self.info.passages
        self._rows: dict[int, _LiveRow] = {}
        self._current: dict[str, Version] = {}
        self._next_row = self._base_rows
        self._write_lock = threading.Lock()
        try:
            self._log = sqlite3.connect(self.log_path, check_same_thread=False, isolation_level=None)
            self._log.execute("PRAGMA journal_mode=WAL")
            self._log.execute("PRAGMA synchronous=FULL")
            self._log.executescript(
                """
                CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
                CREATE TABLE IF NOT EXISTS changes (
                    seq INTEGER PRIMARY KEY, id TEXT NOT NULL, version INTEGER NOT NULL, row INTEGER,
                    title TEXT, text TEXT, tokens BLOB, vector BLOB);
                """
            )
            self._check_meta()
        except sqlite3.DatabaseError as error:
            raise ArtifactError(f"the document log {self.log_path} is unreadable: {error}") from error
        for change in self.logged():
            self._remember(change)

    def _check_meta(self) -> None:
        """Record what the log's changes apply to, or refuse a log written over another base."""
        expected = {
            "schema_version": LOG_SCHEMA_VERSION,
            "corpus_checksum": self.info.corpus_checksum,
            "tokenizer_fingerprint": self.info.tokenizer_fingerprint,
            "segment_template": self.info.segment_template,
        }
        found = dict(self._log.execute("SELECT key, value FROM meta").fetchall())
        if found == expected:
            return
        (changes,) = self._log.execute("SELECT count(*) FROM changes").fetchone()
        if not changes:  # nothing logged over the old base (a corpus rebuilt on purpose): start anew
            self._log.execute("BEGIN IMMEDIATE")
            self._log.execute("DELETE FROM meta")
            self._log.executemany("INSERT INTO meta VALUES (?, ?)", expected.items())
            self._log.execute("COMMIT")
            return
        different = sorted(key for key in expected if found.get(key) != expected[key])
        raise ArtifactError(
            f"the document log {self.log_path} holds {changes} changes written over another base store "
            f"({', '.join(different)} differ): move it aside to serve the rebuilt corpus without them"
        )

    def logged(self) -> Iterator[Change]:
        """Every change in the log, in the order it was committed (what a start replays)."""
        rows = self._log.execute(
            "SELECT id, version, row, title, text, tokens, vector FROM changes ORDER BY seq"
        ).fetchall()
        for passage_id, version, row, title, text, tokens, vector in rows:
            if row is None:
                yield Change(passage_id, version)
                continue
            yield Change(
                passage_id,
                version,
                row,
                Passage(passage_id, title, text),
                tuple(int(token) for token in np.frombuffer(tokens, dtype=_TOKEN_DTYPE)),
                np.frombuffer(vector, dtype=_VECTOR_DTYPE),
            )

    @property
    def next_row(self) -> int:
        """The row the next new version gets."""
        return self._next_row

    def version_of(self, passage_id: str) -> Version | None:
        """Where ``passage_id`` stands, None when it never existed."""
        found = self._current.get(passage_id)
        if found is not None:
            return found
        row = self.base_row(passage_id)
        return None if row is None else Version(row, BASE_VERSION)

    def base_row(self, passage_id: str) -> int | None:
        """The row ``passage_id`` has in the built store, None when it is not one of its documents."""
        try:
            return super().row_of(passage_id)
        except InvalidInputError:
            return None

    def commit(self, changes: Sequence[Change]) -> None:
        """Write ``changes`` in one transaction, durable (fsynced) when this returns, then serve them.

        Each new version's row must be the next one (:attr:`next_row`, counting on within the batch).
        """
        expected = self._next_row
        for change in changes:
            if change.row is not None:
                if change.row != expected or change.passage is None or change.vector is None:
                    raise InvalidInputError(
                        f"change {change.id!r}: row {change.row}, the next row is {expected}"
                    )
                expected += 1
        records = [
            (
                change.id,
                change.version,
                change.row,
                None if change.passage is None else change.passage.title,
                None if change.passage is None else change.passage.text,
                None if change.row is None else np.asarray(change.tokens, dtype=_TOKEN_DTYPE).tobytes(),
                None if change.vector is None else np.asarray(change.vector, dtype=_VECTOR_DTYPE).tobytes(),
            )
            for change in changes
        ]
        with self._write_lock:
            self._log.execute("BEGIN IMMEDIATE")
            try:
                (last,) = self._log.execute("SELECT MAX(row) FROM changes").fetchone()
                if last is not None and last + 1 != self._next_row:
                    raise ConflictError(
                        f"another process wrote to the document log {self.log_path}: change documents "
                        "through the service that serves them, or offline while none does"
                    )
                self._log.executemany(
                    "INSERT INTO changes (id, version, row, title, text, tokens, vector) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?)",
                    records,
                )
                self._log.execute("COMMIT")
            except BaseException:
                self._log.execute("ROLLBACK")
                raise
            for change in changes:
                self._remember(change)

    def _remember(self, change: Change) -> None:
        if change.row is not None:
            assert change.passage is not None
            self._rows[change.row] = _LiveRow(change.passage, change.tokens, change.version)
            self._next_row = max(self._next_row, change.row + 1)
        self._current[change.id] = Version(change.row, change.version)

    def __len__(self) -> int:
        return self._next_row

    def _check_row(self, row: int) -> None:
        if row not in self._rows and not 0 <= row < self._base_rows:
            raise InvalidInputError(f"passage row {row} out of range [0, {self._next_row})")

    def tokens(self, row: int) -> tuple[int, ...]:  # type: ignore[override]  # the base's is cached
        live = self._rows.get(row)
        return live.tokens if live is not None else super().tokens(row)

    def passage(self, row: int) -> Passage:
        live = self._rows.get(row)
        return live.passage if live is not None else super().passage(row)

    def row_of(self, passage_id: str) -> int:
        """The row of ``passage_id``'s current version; NotFoundError once it was deleted."""
        found = self.version_of(passage_id)
        if found is None or found.row is None:
            raise NotFoundError(f"unknown document id {passage_id!r}")
        return found.row

    def close(self) -> None:
        self._log.close()
        super().close()
