"""A corpus that changes while it serves: the one writer of the live store and the live index.

A change is made in this order, under one lock (one writer at a time):

1. each new version is tokenized as its prompt segment (its own row's label) and embedded, and
   everything that can fail on it is checked and worked out for the index (its vectors, its rows,
   each text's terms: :meth:`~specrag.retrieval.vector_index.VectorIndex.prepare_changes`);
2. the changes are committed to the store's log, fsynced
   (:class:`~specrag.pipeline.store.live_store.LiveStore`): from here on the change survives a crash;
3. the index appends the new rows and hides the replaced or deleted ones in one swap
   (:meth:`~specrag.retrieval.vector_index.VectorIndex.apply_prepared`): a search that starts
   afterwards sees the new versions only, one that started before sees the old ones only.

Only then is the change acknowledged. Should step 3 fail all the same, the change is durable and
is not reported failed: it is acknowledged as not visible yet (:attr:`Written.visible` false), kept
pending, and the corpus takes no write (:class:`~specrag.errors.WritesSuspendedError`, and
:attr:`LiveCorpus.suspended` says why) until :meth:`LiveCorpus.catch_up` has applied it; each step
of the apply skips what it did already, so the retry completes it.

At start :meth:`LiveCorpus.replayed` replays the log onto the loaded index: the logged vectors and
texts, not embedded again.

Hidden rows stay in the index's lists, skipped by every search, until a compaction drops them: once
they reach :data:`COMPACT_SHARE` of the rows it holds, a background thread copies the lists
without them (same centroids and codes) and swaps the copy in. Searches run on throughout (one in
flight finishes on the lists it started on); changes wait for the swap, as they would for
another writer.

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

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from specrag.errors import (
    ArtifactError,
    InvalidInputError,
    NotFoundError,
    TooLargeError,
    WritesSuspendedError,
)
from specrag.pipeline.store.document_store import TokenizeBatch, render_segment
from specrag.pipeline.store.live_log import Change
from specrag.pipeline.store.live_store import LiveStore
from specrag.pipeline.store.overlay_store import BASE_VERSION, Version
from specrag.retrieval.corpus import Passage
from specrag.retrieval.live_index import Retrainable
from specrag.retrieval.text import normalize_text
from specrag.retrieval.vector_index import PreparedChanges, VectorIndex

__all__ = [
    "COMPACT_SHARE",
    "MAX_BATCH_DOCUMENTS",
    "MAX_ID_CHARS",
    "MAX_TEXT_CHARS",
    "RETRAIN_DRIFT",
    "RETRAIN_MIN_SHARE",
    "Document",
    "LiveCorpus",
    "VersionedRows",
    "Written",
    "check_delete_batch",
    "check_document",
    "check_put_batch",
    "check_segment_lengths",
    "current_document",
    "indexed_text",
]

# One request's documents at most (a POST beyond is 413): a batch is one transaction and one
# swap, held under the writer's lock while it is embedded.
MAX_BATCH_DOCUMENTS = 1000
MAX_ID_CHARS = 256
# Ids a URL path segment cannot carry: clients and proxies resolve them as "this" and "parent".
_UNREACHABLE_IDS = frozenset({".", ".."})
MAX_TEXT_CHARS = 100_000
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


@dataclass(frozen=True)
class Document:
    """A document as the API shows it: its current version."""

    id: str
    title: str
    text: str
    version: int


@dataclass(frozen=True)
class Written:
    """The outcome of one document's write: its new version, whether the id was new, and whether
    searches see it yet (false: logged durably, applied once the corpus has caught up)."""

    id: str
    version: int
    created: bool
    visible: bool = True


def check_document(passage_id: object, title: object, text: object) -> Passage:
    """The passage a write names, or InvalidInputError saying what is wrong with it.

    An id must be reachable as one segment of a URL path (``/v1/documents/{id}``, which the
    client quotes whole, ``/`` included): ``.`` and ``..`` are not, a URL resolves them away, and
    an id with blanks around it would be told apart from the trimmed one by invisible characters.
    Every field must be UTF-8 text: JSON can carry a lone surrogate (``"\\ud800"``), which the
    tokenizer and the log cannot store.
    """
    if not isinstance(passage_id, str) or not passage_id.strip() or len(passage_id) > MAX_ID_CHARS:
        raise InvalidInputError(
            f"a document id must be a non-empty string of at most {MAX_ID_CHARS} characters"
        )
    _check_unicode(passage_id, f"document id {passage_id!r}")
    if any(not character.isprintable() for character in passage_id):
        raise InvalidInputError(f"document id {passage_id!r} holds unprintable characters")
    if passage_id != passage_id.strip():
        raise InvalidInputError(f"document id {passage_id!r} starts or ends with a blank")
    if passage_id in _UNREACHABLE_IDS:
        raise InvalidInputError(
            f"document id {passage_id!r} cannot be named in a URL (/v1/documents/{passage_id} "
            "resolves to another path): choose another"
        )
    if not isinstance(title, str):
        raise InvalidInputError(f"document {passage_id!r}: 'title' must be a string")
    _check_unicode(title, f"document {passage_id!r}: 'title'")
    if not isinstance(text, str) or not text.strip():
        raise InvalidInputError(f"document {passage_id!r}: 'text' must be a non-empty string")
    _check_unicode(text, f"document {passage_id!r}: 'text'")
    if len(title) + len(text) > MAX_TEXT_CHARS:
        raise TooLargeError(f"document {passage_id!r} is longer than {MAX_TEXT_CHARS} characters")
    return Passage(passage_id, title, text)


def _check_unicode(value: str, what: str) -> None:
    """InvalidInputError unless ``value`` encodes as UTF-8 (a lone surrogate does not)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidInputError(
            f"{what} is not valid Unicode text: a lone surrogate at character {error.start}"
        ) from None


def indexed_text(passage: Passage) -> str:
    """What both channels index of a passage (as the index build does)."""
    return normalize_text(f"{passage.title}\n{passage.text}")


class VersionedRows(Protocol):
    """What :func:`current_document` reads: where an id stands, and a row's passage."""

    def version_of(self, passage_id: str) -> Version | None: ...

    def passage(self, row: int) -> Passage: ...


def current_document(rows: VersionedRows, passage_id: str) -> Document:
    """The current version of ``passage_id``; NotFoundError when unknown or deleted.

    One read of where the id stands (row and version together), then that row's passage: a write
    racing the read gives the old document or the new, never a mix of the two."""
    current = rows.version_of(passage_id)
    if current is None or current.row is None:
        raise NotFoundError(f"unknown document id {passage_id!r}")
    passage = rows.passage(current.row)
    return Document(passage.id, passage.title, passage.text, current.version)


def check_put_batch(passages: Sequence[Passage]) -> None:
    """InvalidInputError or TooLargeError unless ``passages`` are one request's worth (one to
    :data:`MAX_BATCH_DOCUMENTS`, each id once): a request is one transaction under the writer's lock."""
    if not passages:
        raise InvalidInputError("no documents given")
    _check_batch_size(len(passages))
    if len({passage.id for passage in passages}) < len(passages):
        raise InvalidInputError("a request names each document id once")


def check_delete_batch(passage_ids: Sequence[str]) -> None:
    """As :func:`check_put_batch` for a deletion (an id named twice is deleted once)."""
    if not passage_ids:
        raise InvalidInputError("no document ids given")
    _check_batch_size(len(passage_ids))


def _check_batch_size(count: int) -> None:
    if count > MAX_BATCH_DOCUMENTS:
        raise TooLargeError(f"at most {MAX_BATCH_DOCUMENTS} documents a request, got {count}")


def check_segment_lengths(
    passages: Sequence[Passage], tokens: Sequence[Sequence[int]], limit: int | None
) -> None:
    """TooLargeError naming the first document whose prompt segment is over ``limit`` tokens (None:
    no limit): a longer document would fit no prompt, and every query retrieving it would fail."""
    if limit is None:
        return
    for passage, token_ids in zip(passages, tokens, strict=True):
        if len(token_ids) > limit:
            raise TooLargeError(
                f"document {passage.id!r} is {len(token_ids)} tokens long; at most {limit} fit the "
                "model's context beside the system prompt, a question and the answer: split it "
                "into several documents"
            )


class LiveCorpus:
    """Adds, replaces and deletes documents of a served store and index, durably and consistently."""

    def __init__(
        self,
        store: LiveStore,
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
        # Changes logged but not applied to the index yet (its apply failed), in log order, and why.
        self._pending: list[PreparedChanges] = []
        self._suspended: str | None = None
        #: The most tokens a document's prompt segment may have (None: no limit), set by whoever
        #: knows the engine's context
        #: (:meth:`~specrag.pipeline.store.prompt.PromptBuilder.document_token_limit`): a longer
        #: document would fit no prompt, and every query that retrieved it would fail.
        self.segment_token_limit: int | None = None

    @classmethod
    def replayed(
        cls,
        store: LiveStore,
        index: VectorIndex,
        tokenize_batch: TokenizeBatch,
        compact_share: float | None = COMPACT_SHARE,
    ) -> LiveCorpus:
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
        return cls(store, index, tokenize_batch, compact_share)

    def get(self, passage_id: str) -> Document:
        """The current version of ``passage_id`` (:func:`current_document`)."""
        return current_document(self.store, passage_id)

    @property
    def suspended(self) -> str | None:
        """Why the corpus takes no writes now (a logged change it could not apply yet), or None."""
        return self._suspended

    def catch_up(self) -> bool:
        """Apply the changes logged but not applied yet, in order; True once none is pending (the
        corpus takes writes again), False when one failed again (:attr:`suspended` says why)."""
        with self._lock:
            return self._catch_up()

    def put(self, passages: Sequence[Passage]) -> list[Written]:
        """Add or replace each of ``passages`` (ids distinct), all visible at once when this returns."""
        check_put_batch(passages)
        self.index.check_growable()  # before anything is logged: a logged change must replay
        embedder = self.index.embedder
        assert embedder is not None
        texts = [indexed_text(passage) for passage in passages]
        vectors = np.asarray(embedder.embed(texts), dtype=np.float32)
        with self._lock:
            self._take_writes()
            first = self.store.next_row
            rows = range(first, first + len(passages))
            template = self.store.info.segment_template
            tokens = self._tokenize_batch(
                [render_segment(row, passage, template) for row, passage in zip(rows, passages, strict=True)]
            )
            check_segment_lengths(passages, tokens, self.segment_token_limit)
            changes: list[Change] = []
            retired: list[int] = []
            written: list[Written] = []
            for row, passage, token_ids, vector in zip(rows, passages, tokens, vectors, strict=True):
                before = self.store.version_of(passage.id)
                version = BASE_VERSION if before is None else before.version + 1
                if before is not None and before.row is not None:
                    retired.append(before.row)
                changes.append(Change(passage.id, version, row, passage, tuple(token_ids), vector))
                written.append(Written(passage.id, version, before is None or before.row is None))
            prepared = self._prepared([p.id for p in passages], vectors, texts, retired)
            self.store.commit(changes)
            if not self._applied(prepared):
                return [Written(w.id, w.version, w.created, visible=False) for w in written]
        self._compact_when_due()
        return written

    def delete(self, passage_ids: Sequence[str]) -> bool:
        """Delete each of ``passage_ids``; NotFoundError (and nothing deleted) if one is unknown.
        Returns whether searches see the deletion yet (false: logged, applied once caught up)."""
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
            if not self._applied(prepared):
                return False
        self._compact_when_due()
        return True

    def _take_writes(self) -> None:
        """Catch up first if changes are pending; WritesSuspendedError while that fails (under the lock)."""
        if self._pending and not self._catch_up():
            raise WritesSuspendedError(
                f"the corpus takes no writes until it has applied a logged change: {self._suspended}"
            )

    def _prepared(
        self, ids: Sequence[str], vectors: np.ndarray, texts: Sequence[str], retired: Sequence[int]
    ) -> PreparedChanges:
        """The change checked and worked out for the index, before it is logged (under the lock)."""
        prepared = self.index.prepare_changes(ids, vectors, texts, retired)
        if prepared.first_row != self.store.next_row:
            raise ArtifactError(
                f"the index shows {prepared.first_row} rows, the store {self.store.next_row}: "
                "restart to replay the log"
            )
        return prepared

    def _applied(self, prepared: PreparedChanges) -> bool:
        """Apply a logged change to the index; on failure keep it pending and stop taking writes
        (under the lock). Returns whether it was applied."""
        self._pending.append(prepared)
        return self._catch_up()

    def _catch_up(self) -> bool:
        """Apply the pending changes in order, stopping at the first that fails (under the lock)."""
        while self._pending:
            prepared = self._pending[0]
            try:
                self.index.apply_prepared(prepared)
            except Exception as error:  # the change is logged: it must be applied, not dropped
                self._suspended = f"applying the change to the index failed: {error!r}"
                logger.exception("a logged change could not be applied to the index; writes suspended")
                return False
            self._pending.pop(0)
            try:
                self._watch_drift(prepared.vectors)
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
        searcher = self.index.searcher
        if not isinstance(searcher, Retrainable) or not len(vectors):  # HNSW: no centroids to drift from
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
