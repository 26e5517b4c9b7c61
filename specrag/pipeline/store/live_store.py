"""The live layer of the document store: documents added, replaced and deleted while serving.

The built store stays the base, untouched. Every change after it is one row of a SQLite log in WAL
mode with ``synchronous=FULL``, so a committed change is on disk (the WAL fsynced) before the call
returns: the service answers a write only after that commit, and a ``kill -9`` at any moment
loses no acknowledged change.

A new or replaced document gets a new row, appended after the base's and every earlier change's,
and rows never change while a process serves: a row names exactly one version of one document.
Everything keyed by row (the knowledge tree through the row label in each segment, batch plans,
conversations) or by a segment's tokens (the document-KV store) therefore never mistakes one
version for another.

History is bounded. The log holds each id's current version only, or a tombstone (id and version,
no text) once it was deleted, so that a version number is never given twice: a commit deletes the
rows it supersedes (``secure_delete``: their bytes are zeroed, not just freed) and the WAL, which
still holds the old pages, is truncated right after a deletion and every
:data:`WAL_TRUNCATE_EVERY` commits. A retired version stays in memory for :data:`RETIRED_GRACE_S`,
for a query whose search ran before the write and still reads its row, then leaves memory and
the document-KV store. At start, before the replay, :meth:`LiveStore.checkpoint`
(:mod:`specrag.pipeline.store.live_checkpoint`) reads the log once, numbers the kept rows anew
right after the base's (nothing refers to a row yet: the index is the base's) and re-tokenizes the
rows that moved, so a start costs time and memory in proportion to the live corpus, not to its
history.

One process writes at a time: the one that opens the log holds its writer lock
(:func:`specrag.locking.hold_writer_lock`) until it closes it, and another meets it at once. A
commit checks too that nobody else wrote (the log's last sequence number and each id's last
version are what this store holds), for a writer that the lock cannot see. Each log row carries a
checksum, as the base's rows, checked at start (the log's format:
:mod:`specrag.pipeline.store.live_log`); the embedder that made the logged vectors is recorded and
checked against the index's.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from specrag.errors import ArtifactError, ConflictError, InvalidInputError
from specrag.locking import hold_writer_lock
from specrag.pipeline.store.document_store import DocumentStore, TokenizeBatch
from specrag.pipeline.store.live_checkpoint import checkpoint_log
from specrag.pipeline.store.live_log import (
    COLUMNS,
    INSERT,
    TOKEN_DTYPE,
    Change,
    check_other_logs,
    live_log_path,
    open_log,
    record_of,
    truncate_wal,
    verified_change,
)
from specrag.pipeline.store.overlay_store import (
    BASE_VERSION,
    RETIRED_GRACE_S,
    OverlayRow,
    OverlayStore,
    Version,
)
from specrag.retrieval.corpus import Passage

if TYPE_CHECKING:
    from specrag.retrieval.embedders.embedder import Embedder

__all__ = ["WAL_TRUNCATE_EVERY", "LiveStore"]

logger = logging.getLogger(__name__)

# Commits between two truncations of the WAL (which holds the superseded rows' old pages).
WAL_TRUNCATE_EVERY = 64


@dataclass(frozen=True)
class _Prepared:
    """What a commit installs in memory once it is durable, all computed before the SQL COMMIT."""

    rows: list[tuple[int, OverlayRow]]
    current: list[tuple[str, Version]]
    retired: list[int]
    next_row: int
    retired_segments: list[bytes]  # the retired rows' tokens, where there is a document-KV store


class LiveStore(OverlayStore):
    """A built store and its log of changes, read as one store: rows past the base are the log's.

    Opening it takes the log's writer lock (:class:`ConflictError` at once while another process
    holds it); :meth:`checkpoint` then loads the log (:meth:`LiveCorpus.replayed
    <specrag.pipeline.store.live_corpus.LiveCorpus.replayed>` calls it). Reads are safe from any thread;
    writes (:meth:`commit`) come from one writer at a time (the live corpus holds its lock around
    them). It is the corpus's :class:`~specrag.pipeline.store.live_corpus.DurableRecord` whose
    readers take a change at its commit.
    """

    until_shown = "applied a logged change"
    show_failed = "applying the change to the index failed"

    def __init__(
        self,
        path: Path,
        log_path: Path | None = None,
        *,
        data_dir: Path | None = None,
        document_kv_dir: Path | None = None,
        retired_grace_s: float = RETIRED_GRACE_S,
    ) -> None:
        """``data_dir`` is what the refusal of a second writer names (default: the log's directory);
        ``document_kv_dir`` is the document-KV store whose entries of retired versions are removed."""
        super().__init__(path, document_kv_dir=document_kv_dir, retired_grace_s=retired_grace_s)
        self.log_path = log_path or live_log_path(path)
        self._last_seq = 0
        self._loaded = False
        self._commits = 0
        where = data_dir or self.log_path.parent
        try:
            self._release = hold_writer_lock(
                self.log_path,
                lambda pid: (
                    f"another process (pid {pid}) is writing the documents of the data directory {where} "
                    f"(it holds the lock of {self.log_path}): change documents through the service that "
                    "serves them (`specrag documents --url URL ...`), or stop it first"
                ),
            )
        except OSError as error:  # a read-only data directory: no log can be written there either
            super().close()
            raise ArtifactError(f"cannot lock the document log {self.log_path}: {error}") from error
        try:
            self._log = open_log(self.log_path, self.info)
            check_other_logs(self.log_path)
        except BaseException:
            self.close()
            raise

    def checkpoint(
        self,
        tokenize_batch: TokenizeBatch,
        embedder: Embedder | None = None,
        indexed_text: Callable[[Passage], str] | None = None,
    ) -> list[Change]:
        """Read the log once, keep each id's last change only, number the kept rows anew right after
        the base's (re-tokenizing the rows that moved, as :meth:`LiveCorpus.put` tokenizes), check
        that ``embedder`` made the logged vectors (``indexed_text`` is what it embeds of a passage),
        and load the result; returns the changes to replay, in row order.

        Run at start, before anything refers to a row of the log (the index holds the base's).
        """
        with self._overlay_lock:
            checkpointed = checkpoint_log(
                self._log,
                self.log_path,
                self._base_rows,
                self.info.segment_template,
                tokenize_batch,
                embedder,
                indexed_text,
            )
            changes, dropped = checkpointed.changes, checkpointed.dropped
            self._rows = {
                change.row: OverlayRow(change.passage, change.tokens, change.version)
                for change in changes
                if change.row is not None and change.passage is not None
            }
            self._current = {change.id: Version(change.row, change.version) for change in changes}
            self._next_row = self._base_rows + len(self._rows)
            (last,) = self._log.execute("SELECT MAX(seq) FROM changes").fetchone()
            self._last_seq = last or 0
            self._loaded = True
        self._purge_document_kv(dropped)
        return [change for change in changes if change.row is not None] + [
            change for change in changes if change.row is None
        ]

    def logged(self) -> Iterator[Change]:
        """Each id's last change in the log (its current version, or a tombstone once deleted), in
        the order they were committed, each checked against its checksum."""
        found = self._log.execute(
            f"SELECT {COLUMNS} FROM changes WHERE seq IN (SELECT MAX(seq) FROM changes GROUP BY id) "
            "ORDER BY seq"
        ).fetchall()
        for one in found:
            yield verified_change(self.log_path, one)

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
            return DocumentStore.row_of(self, passage_id)  # the built store's row, not the overlay's
        except InvalidInputError:
            return None

    def commit(self, changes: Sequence[Change]) -> None:
        """Write ``changes`` in one transaction, durable (fsynced) when this returns, then serve them.

        Each new version's row must be the next one (:attr:`next_row`, counting on within the batch)
        and each version the one after the id's current one. Everything that can be checked is
        checked, and everything memory takes is built, before the SQL COMMIT; after it, memory takes
        it by plain assignments, and should even that fail it is read again from the log.
        """
        if not self._loaded:
            raise InvalidInputError(
                f"the document log {self.log_path} is written after its checkpoint, never after stop_writing"
            )
        expected = self._next_row
        for change in changes:
            before = self.version_of(change.id)
            version = BASE_VERSION if before is None else before.version + 1
            if change.version != version:
                raise InvalidInputError(
                    f"change {change.id!r}: version {change.version}, the next version is {version}"
                )
            if change.row is not None:
                if change.row != expected or change.passage is None or change.vector is None:
                    raise InvalidInputError(
                        f"change {change.id!r}: row {change.row}, the next row is {expected}"
                    )
                expected += 1
        records = [record_of(change) for change in changes]
        prepared = self._prepare(changes, expected)
        with self._overlay_lock:
            self._log.execute("BEGIN IMMEDIATE")
            try:
                self._check_no_other_writer(changes)
                self._log.executemany("DELETE FROM changes WHERE id = ?", [(c.id,) for c in changes])
                self._log.executemany(INSERT, records)
                (last,) = self._log.execute("SELECT MAX(seq) FROM changes").fetchone()
                self._log.execute("COMMIT")
            except BaseException:
                with contextlib.suppress(sqlite3.Error):  # a COMMIT that failed may have rolled back
                    self._log.execute("ROLLBACK")
                raise
            try:
                self._install(prepared, last)
            except Exception:
                logger.exception("installing a committed change in memory failed: reading the log again")
                self._refresh(prepared.next_row, [row for _, row in self._retired] + prepared.retired)
            self._commits += 1
            if any(change.row is None for change in changes) or self._commits % WAL_TRUNCATE_EVERY == 0:
                # A deleted text leaves the WAL at once, a replaced one soon.
                truncate_wal(self._log, self.log_path)
        # At once, and again when the row leaves memory (a query in flight may have stored it anew).
        self._purge_document_kv(prepared.retired_segments)
        self.drop_retired()

    def show(self, first_row: int, changes: Sequence[Change], retired: Sequence[int]) -> None:
        """Nothing: memory took the change at its :meth:`commit`, before the index shows it."""

    def _prepare(self, changes: Sequence[Change], next_row: int) -> _Prepared:
        rows, current, retired = [], [], []
        for change in changes:
            before = self.version_of(change.id)
            if before is not None and before.row is not None:
                retired.append(before.row)
            if change.row is not None:
                assert change.passage is not None
                rows.append((change.row, OverlayRow(change.passage, change.tokens, change.version)))
            current.append((change.id, Version(change.row, change.version)))
        return _Prepared(rows, current, retired, next_row, self._segments_of(retired))

    def _check_no_other_writer(self, changes: Sequence[Change]) -> None:
        """ConflictError unless the log is as this store left it (inside the write transaction)."""
        (last,) = self._log.execute("SELECT MAX(seq) FROM changes").fetchone()
        written = (last or 0) != self._last_seq
        for change in changes if not written else ():
            found = self._log.execute(
                "SELECT version FROM changes WHERE id = ? ORDER BY seq DESC LIMIT 1", (change.id,)
            ).fetchone()
            held = self._current.get(change.id)
            written = (None if found is None else found[0]) != (None if held is None else held.version)
            if written:
                break
        if written:
            raise ConflictError(
                f"another process wrote to the document log {self.log_path}: change documents "
                "through the service that serves them, or offline while none does"
            )

    def _install(self, prepared: _Prepared, last_seq: int) -> None:
        """Memory takes a committed change: plain assignments of what :meth:`_prepare` built."""
        self._take(prepared.rows, prepared.current, prepared.retired, prepared.next_row)
        self._last_seq = last_seq

    def _refresh(self, next_row: int, retired: list[int]) -> None:
        """Memory read again from the log, after a committed change failed to install: the log is
        the truth. Rows retired meanwhile stay readable for their grace period, counted from now."""
        found = self._log.execute("SELECT id, version, row, title, text, tokens FROM changes").fetchall()
        still = set(retired)
        rows = {row: entry for row, entry in self._rows.items() if row in still}
        current: dict[str, Version] = {}
        for passage_id, version, row, title, text, tokens in found:
            current[passage_id] = Version(row, version)
            if row is not None:
                token_ids = tuple(int(token) for token in np.frombuffer(tokens, dtype=TOKEN_DTYPE))
                rows[row] = OverlayRow(Passage(passage_id, title, text), token_ids, version)
        (last,) = self._log.execute("SELECT MAX(seq) FROM changes").fetchone()
        now = time.monotonic()
        self._rows, self._current = rows, current
        self._retired = deque((now, row) for row in dict.fromkeys(retired))
        self._next_row, self._last_seq = next_row, last or 0

    def stop_writing(self) -> None:
        """Close the log and let another writer in while reads go on (a process that loaded the
        corpus only to read it: a test session's shared assets); commits are refused from here on."""
        with self._overlay_lock:
            self._loaded = False
            self._log.close()
            self._release()

    def close(self) -> None:
        """Close the log and let another writer in (idempotent)."""
        log = getattr(self, "_log", None)
        if log is not None:
            log.close()
        self._release()
        super().close()
