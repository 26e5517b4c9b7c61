"""A corpus that changes while it serves: the one writer of its durable record and of the index.

The durable record is pluggable (:class:`DurableRecord`): the live store's SQLite log
(:class:`~specrag.pipeline.store.live_store.LiveStore`, under a local or a sharded index:
:meth:`LiveCorpus.replayed`) or a pgvector table (:class:`~specrag.pipeline.store.table_corpus.TableStore`:
:func:`~specrag.pipeline.store.table_corpus.open_table_corpus`). A change is made in this order,
under one lock (one writer at a time):

1. each new version is tokenized as its prompt segment (its own row's label) and embedded, and
   everything that can fail on it is checked and worked out for the index (its vectors, its rows,
   each text's terms: :meth:`~specrag.retrieval.vector_index.VectorIndex.prepare_changes`);
2. the changes are made durable in one transaction (the log's commit, fsynced; the table's
   COMMIT): from here on the change survives a crash;
3. the record's readers take it (:meth:`DurableRecord.show`), then the index appends the new rows
   and hides the replaced or deleted ones in one swap
   (:meth:`~specrag.retrieval.vector_index.VectorIndex.apply_prepared`): a search that starts
   afterwards sees the new versions only, one that started before sees the old ones only.

Only then is the change acknowledged. Should step 3 fail all the same, the change is durable and
is not reported failed: it is acknowledged as not visible yet (:attr:`Written.visible` false), kept
pending, and the corpus takes no write (:class:`~specrag.errors.WritesSuspendedError`, and
:attr:`LiveCorpus.suspended` says why) until :meth:`LiveCorpus.catch_up` has shown it; each step
of the show skips what it did already, so the retry completes it.

At start :meth:`LiveCorpus.replayed` replays the log onto the loaded index: the logged vectors and
texts, not embedded again. A table is read at start instead, and the changes other writers commit
to it later are shown by :meth:`LiveCorpus.follow`, as the corpus's own are.

Hidden rows stay in the index's lists, skipped by every search, until a compaction drops them: once
they reach :data:`COMPACT_SHARE` of the rows it holds, a background thread copies the lists
without them (same centroids and codes) and swaps the copy in. Searches run on throughout (one in
flight finishes on the lists it started on); changes wait for the swap, as they would for
another writer. (A table holds current versions only: its corpus is not compacted.)

The centroids stay those of the build until the documents added since drift away from them: a
live corpus compares how far each added vector lies from its nearest centroid with how far the
index's own rows lie (a sample, read when the first document is added). Once the added documents
are :data:`RETRAIN_MIN_SHARE` of the index and lie :data:`RETRAIN_DRIFT` times as far on average,
the background thread trains new centroids on the rows kept (flat lists only: they hold the
vectors) instead of copying the lists, and swaps that index in the same way. An HNSW index has no
centroids (:class:`~specrag.retrieval.live_index.Retrainable` is IVF's): it is compacted, by a new
graph over the rows kept, and never re-trained.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import numpy as np

from specrag.errors import ArtifactError, InvalidInputError, NotFoundError, WritesSuspendedError
from specrag.pipeline.store.document_store import StoreInfo, TokenizeBatch, render_segment
from specrag.pipeline.store.document_writes import (
    Document,
    Written,
    check_delete_batch,
    check_put_batch,
    check_segment_lengths,
    current_document,
    indexed_text,
)
from specrag.pipeline.store.live_log import Change
from specrag.pipeline.store.live_store import LiveStore
from specrag.pipeline.store.overlay_store import BASE_VERSION, Version
from specrag.retrieval.corpus import Passage
from specrag.retrieval.vector_index import PreparedChanges, VectorIndex

__all__ = [
    "COMPACT_SHARE",
    "RETRAIN_DRIFT",
    "RETRAIN_MIN_SHARE",
    "DurableRecord",
    "LiveCorpus",
]

# Compact the index once this share of the rows it holds is hidden (replaced or deleted): each
# hidden row costs every search that scans its list, and compaction copies every list once.
COMPACT_SHARE = 0.2
# Re-train the centroids once the documents added since the last training are this share of the
# index and lie this many times as far from their nearest centroid as its own rows do: between
# what bench.updates measured for added vectors of the build's own distribution and of another
# (docs/updates.md). Re-training holds writes back for a while, so it waits for real drift.
RETRAIN_MIN_SHARE = 0.1
RETRAIN_DRIFT = 1.15
# Rows of the index read to learn how far its own rows lie from their centroids.
_REFERENCE_SAMPLE = 2000

logger = logging.getLogger(__name__)


class DurableRecord(Protocol):
    """Where a corpus makes its changes durable, read as its document store: the rows past the
    base's are the versions written since, each new version a new row (:attr:`next_row` on).

    ``until_shown`` and ``show_failed`` word the messages of a corpus that holds a durable change
    it could not show yet: what it waits for, and what failed.
    """

    info: StoreInfo
    until_shown: str
    show_failed: str

    @property
    def next_row(self) -> int: ...

    def __len__(self) -> int: ...

    def version_of(self, passage_id: str) -> Version | None: ...

    def passage(self, row: int) -> Passage: ...

    def commit(self, changes: Sequence[Change]) -> None:
        """Make ``changes`` durable in one transaction (none of them when this raises)."""
        ...

    def show(self, first_row: int, changes: Sequence[Change], retired: Sequence[int]) -> None:
        """Let readers of the record find committed ``changes`` (new rows from ``first_row``, the
        ``retired`` rows replaced), before the index shows them; a retry skips what was done."""
        ...


Record = TypeVar("Record", bound=DurableRecord)


@dataclass(frozen=True)
class _Pending:
    """A durable change not shown yet: what the index and the record's readers take of it."""

    prepared: PreparedChanges
    changes: tuple[Change, ...]


class LiveCorpus(Generic[Record]):
    """Adds, replaces and deletes documents of a served store and index, durably and consistently
    (the documents API's :class:`~specrag.service.http.documents.DocumentCorpus`)."""

    def __init__(
        self,
        store: Record,
        index: VectorIndex,
        tokenize_batch: TokenizeBatch,
        compact_share: float | None = COMPACT_SHARE,
    ) -> None:
        """``compact_share`` None never compacts in the background (:meth:`compact` still does)."""
        if index.embedder is None:
            raise InvalidInputError("a live corpus embeds its documents: the index needs its embedder")
        if len(store) != len(index.passage_ids):
            raise ArtifactError(
                f"the store has {len(store)} rows and the index {len(index.passage_ids)}: "
                "rebuild them together"
            )
        self.store = store
        self.index = index
        self._tokenize_batch = tokenize_batch
        self._lock = threading.Lock()
        self._compact_share = compact_share
        self._compacting: threading.Thread | None = None
        self.compactions = 0
        self.retrainings = 0
        self._reference_distance: float | None = None  # of the index's own rows; None: not read yet
        self._added_distance = 0.0  # summed over the documents added since the last training
        self._added = 0
        # Changes made durable but not shown yet (showing failed), in order; and why.
        self._pending: list[_Pending] = []
        self._suspended: str | None = None
        #: The most tokens a document's prompt segment may have (None: no limit), set by whoever
        #: knows the engine's context
        #: (:meth:`~specrag.pipeline.store.prompt.PromptBuilder.document_token_limit`): a longer
        #: document would fit no prompt, and every query that retrieved it would fail.
        self.segment_token_limit: int | None = None

    @staticmethod
    def replayed(
        store: LiveStore,
        index: VectorIndex,
        tokenize_batch: TokenizeBatch,
        compact_share: float | None = COMPACT_SHARE,
    ) -> LiveCorpus[LiveStore]:
        """The live corpus over a freshly loaded base index: the store's logged changes applied to it
        (its log checkpointed first: only current versions are replayed)."""
        logged = store.checkpoint(tokenize_batch, index.embedder, indexed_text)
        ids: list[str] = []
        vectors: list[np.ndarray] = []
        texts: list[str] = []
        retired: list[int] = []
        current: dict[str, int | None] = {}
        for change in logged:
            previous = current[change.id] if change.id in current else store.base_row(change.id)
            if previous is not None:
                retired.append(previous)
            current[change.id] = change.row
            if change.row is not None:
                assert change.passage is not None and change.vector is not None
                ids.append(change.id)
                vectors.append(change.vector)
                texts.append(indexed_text(change.passage))
        matrix = np.stack(vectors) if vectors else np.zeros((0, index.dim), dtype=np.float32)
        index.apply_changes(ids, matrix, texts, retired)
        return LiveCorpus(store, index, tokenize_batch, compact_share)

    def get(self, passage_id: str) -> Document:
        """The current version of ``passage_id``
        (:func:`~specrag.pipeline.store.document_writes.current_document`)."""
        return current_document(self.store, passage_id)

    @property
    def suspended(self) -> str | None:
        """Why the corpus takes no writes now (a durable change it could not show yet), or None."""
        return self._suspended

    def catch_up(self) -> bool:
        """Show the durable changes not shown yet, in order; True once none is pending (the corpus
        takes writes again), False when one failed again (:attr:`suspended` says why)."""
        with self._lock:
            return self._catch_up()

    def put(self, passages: Sequence[Passage]) -> list[Written]:
        """Add or replace each of ``passages`` (ids distinct), all visible at once when this returns."""
        check_put_batch(passages)
        self.index.check_growable()  # before anything is made durable: a durable change must be shown
        embedder = self.index.embedder
        assert embedder is not None
        texts = [indexed_text(passage) for passage in passages]
        vectors = np.asarray(embedder.embed(texts), dtype=np.float32)
        with self._lock:
            self._take_writes()
            versions, retired, written = [], [], []
            for passage in passages:
                before = self.store.version_of(passage.id)
                versions.append(BASE_VERSION if before is None else before.version + 1)
                if before is not None and before.row is not None:
                    retired.append(before.row)
                written.append(Written(passage.id, versions[-1], before is None or before.row is None))
            changes = self._new_versions(passages, versions, list(vectors))
            check_segment_lengths(passages, [change.tokens for change in changes], self.segment_token_limit)
            prepared = self._prepared([p.id for p in passages], vectors, texts, retired)
            self.store.commit(changes)
            if not self._shown(prepared, changes):
                return [dataclasses.replace(one, visible=False) for one in written]
        self._compact_when_due()
        return written

    def delete(self, passage_ids: Sequence[str]) -> bool:
        """Delete each of ``passage_ids``; NotFoundError (and nothing deleted) if one is unknown.
        Returns whether searches see the deletion yet (false: durable, shown once caught up)."""
        check_delete_batch(passage_ids)
        with self._lock:
            self._take_writes()
            changes, retired = [], []
            for passage_id in dict.fromkeys(passage_ids):
                before = self.store.version_of(passage_id)
                if before is None or before.row is None:
                    raise NotFoundError(f"unknown document id {passage_id!r}")
                retired.append(before.row)
                changes.append(Change(passage_id, before.version + 1))
            prepared = self._prepared([], np.zeros((0, self.index.dim), dtype=np.float32), [], retired)
            self.store.commit(changes)
            if not self._shown(prepared, changes):
                return False
        self._compact_when_due()
        return True

    def follow(self, read: Callable[[], Sequence[tuple[str, Passage | None, int]]]) -> int:
        """Show the changes another writer committed to the record. ``read``, called under the
        writer's lock once the corpus's own changes are shown, gives each id whose record differs
        from what the corpus shows: its passage there (None: gone) and its version. Each is shown
        as the corpus's own writes are: a new version gets a new row (its prompt segment tokenized
        with its own row label, so no cached form is shared with the old one), the old row hidden.
        The record holds the vectors its searcher ranks by: the index takes none of them. Returns
        how many ids changed; WritesSuspendedError while a change of its own is not shown yet."""
        with self._lock:
            self._take_writes()
            found = read()
            if not found:
                return 0
            passages, versions, gone, retired = [], [], [], []
            for passage_id, passage, version in found:
                before = self.store.version_of(passage_id)
                if before is not None and before.row is not None:
                    retired.append(before.row)
                if passage is None:
                    gone.append(Change(passage_id, version))
                else:
                    passages.append(passage)
                    versions.append(version)
            changes = self._new_versions(passages, versions, [None] * len(passages)) + gone
            texts = [indexed_text(passage) for passage in passages]
            vectors = np.zeros((len(passages), self.index.dim), np.float32)
            self._shown(self._prepared([p.id for p in passages], vectors, texts, retired), changes)
            return len(found)

    def _new_versions(
        self, passages: Sequence[Passage], versions: Sequence[int], vectors: Sequence[np.ndarray | None]
    ) -> list[Change]:
        """Each passage's new version as a change on the next rows, its prompt segment tokenized
        with its own row label (under the lock)."""
        if not passages:
            return []
        first = self.store.next_row
        rows = range(first, first + len(passages))
        template = self.store.info.segment_template
        tokens = self._tokenize_batch(
            [render_segment(row, passage, template) for row, passage in zip(rows, passages, strict=True)]
        )
        return [
            Change(passage.id, version, row, passage, tuple(token_ids), vector)
            for row, passage, version, token_ids, vector in zip(
                rows, passages, versions, tokens, vectors, strict=True
            )
        ]

    def _take_writes(self) -> None:
        """Catch up first if changes are pending; WritesSuspendedError while that fails (under the lock)."""
        if self._pending and not self._catch_up():
            raise WritesSuspendedError(
                f"the corpus takes no writes until it has {self.store.until_shown}: {self._suspended}"
            )

    def _prepared(
        self, ids: Sequence[str], vectors: np.ndarray, texts: Sequence[str], retired: Sequence[int]
    ) -> PreparedChanges:
        """The change checked and worked out for the index, before it is made durable (under the lock)."""
        prepared = self.index.prepare_changes(ids, vectors, texts, retired)
        if prepared.first_row != self.store.next_row:
            raise ArtifactError(
                f"the index shows {prepared.first_row} rows, the store {self.store.next_row}: "
                "restart to load both anew"
            )
        return prepared

    def _shown(self, prepared: PreparedChanges, changes: Sequence[Change]) -> bool:
        """Show a durable change; on failure keep it pending and stop taking writes (under the
        lock). Returns whether it was shown."""
        self._pending.append(_Pending(prepared, tuple(changes)))
        return self._catch_up()

    def _catch_up(self) -> bool:
        """Show the pending changes in order, stopping at the first that fails (under the lock):
        the record's readers take each first, then the index swaps it in."""
        while self._pending:
            pending = self._pending[0]
            try:
                self.store.show(pending.prepared.first_row, pending.changes, pending.prepared.retired)
                self.index.apply_prepared(pending.prepared)
            except Exception as error:  # durable: it must be shown, not dropped
                self._suspended = f"{self.store.show_failed}: {error!r}"
                logger.exception("%s; writes suspended", self.store.show_failed)
                return False
            self._pending.pop(0)
            try:
                self._watch_drift(pending.prepared.vectors)
            except Exception:  # a statistic: missing it must not fail a write that was applied
                logger.exception("the drift of added documents could not be measured")
        self._suspended = None
        return True

    def compact(self, retrain: bool = False) -> int:
        """Drop the hidden rows from the index now, training new centroids when ``retrain``
        (changes wait, searches do not); returns how many rows were dropped."""
        with self._lock:
            self._take_writes()
            dropped = self.index.compact(retrain)
            if retrain:
                self._reference_distance, self._added_distance, self._added = None, 0.0, 0
        if retrain:
            self.retrainings += 1
        else:
            self.compactions += 1
        return dropped

    @property
    def drift(self) -> float | None:
        """How many times as far the documents added since the last training lie from their
        nearest centroid as the index's own rows (None before any was added, or without flat lists)."""
        if not self._added or not self._reference_distance:
            return None
        return self._added_distance / self._added / self._reference_distance

    def _watch_drift(self, vectors: np.ndarray) -> None:
        """Add ``vectors``' distances to their centroids to the running drift (under the lock)."""
        searcher = self.index.retrainable
        if searcher is None or not len(vectors):  # HNSW: no centroids to drift from
            return
        if self._reference_distance is None:
            try:
                rows, stored = searcher.stored_vectors(self.index.visible_rows)
            except InvalidInputError:  # SQ8 or PQ lists: no vectors to re-train on, no drift to watch
                self._reference_distance = 0.0
                return
            sample = np.random.default_rng(0).choice(
                len(rows), min(len(rows), _REFERENCE_SAMPLE), replace=False
            )
            self._reference_distance = float(searcher.centroid_distance(stored[sample]).mean())
        self._added_distance += float(searcher.centroid_distance(vectors).sum())
        self._added += len(vectors)

    def _compact_when_due(self) -> None:
        """Start a background compaction once hidden rows pass their share, or a re-training
        once added documents drifted (one at a time)."""
        if self._compact_share is None or (self._compacting is not None and self._compacting.is_alive()):
            return
        if self._pending:  # the index is part-applied: compaction waits for the catch-up
            return
        held = self.index.searcher.ntotal
        drift = self.drift
        retrain = drift is not None and drift >= RETRAIN_DRIFT and self._added >= RETRAIN_MIN_SHARE * held
        if not held or (not retrain and self.index.removable_rows < self._compact_share * held):
            return
        self._compacting = threading.Thread(
            target=self.compact, args=(retrain,), name="specrag-compaction", daemon=True
        )
        self._compacting.start()

    def wait_for_compaction(self) -> None:
        """Return once the background compaction in progress (if any) is done (tests, benchmarks)."""
        if self._compacting is not None:
            self._compacting.join()
