"""A built document store with the versions written since start held over it, in memory.

Both corpora that change while serving keep the store built at start as their base, untouched, and
append each new version as a new row after it: the live corpus's rows come from its SQLite log
(:class:`~specrag.pipeline.store.live_store.LiveStore`), a pgvector table's from the table
(:class:`~specrag.pipeline.store.table_corpus.TableStore`). What they share is here, once: reading
a row from memory or the base, where each id stands (:class:`Version`), and the retired rows'
grace period. A replaced or deleted version stays readable for :data:`RETIRED_GRACE_S`, for a
query whose search ran before the write and still reads its row, then leaves memory; its
document-KV entry (keyed by the segment's tokens) is removed at once and again when the row leaves
memory, since a query in flight may have stored it anew.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specrag.errors import ArtifactError, InvalidInputError, NotFoundError
from specrag.pipeline.store.document_store import DocumentStore
from specrag.pipeline.store.live_log import TOKEN_DTYPE
from specrag.retrieval.corpus import Passage

__all__ = ["BASE_VERSION", "RETIRED_GRACE_S", "OverlayRow", "OverlayStore", "Version"]

logger = logging.getLogger(__name__)

# Every document of the built corpus is version 1; each change to an id counts on from there.
BASE_VERSION = 1
# How long a retired version's row stays readable: a query reads the rows its search found while it
# builds its prompts, which ends well within its first token's deadline (60 s by default). Counted
# in time, not in writes, since a burst of writes can pass within one query.
RETIRED_GRACE_S = 300.0


@dataclass(frozen=True)
class Version:
    """Where an id stands: its current row (None once deleted) and version."""

    row: int | None
    version: int


@dataclass(frozen=True)
class OverlayRow:
    """A version written since start: its passage, its prompt segment's tokens, its version."""

    passage: Passage
    tokens: tuple[int, ...]
    version: int


class OverlayStore(DocumentStore):
    """The built store at ``path`` and the rows past it, held in memory, read as one store.

    ``document_kv_dir`` is the document-KV store whose entries of retired versions are removed
    (None: there is none). :attr:`_overlay_lock` guards the rows in memory; a subclass holds it around its
    own changes to them too.
    """

    def __init__(
        self, path: Path, *, document_kv_dir: Path | None = None, retired_grace_s: float = RETIRED_GRACE_S
    ) -> None:
        super().__init__(path)
        self.document_kv_dir = document_kv_dir
        self._grace_s = retired_grace_s
        self._base_rows = self.info.passages
        self._rows: dict[int, OverlayRow] = {}
        self._current: dict[str, Version] = {}
        self._next_row = self._base_rows
        self._retired: deque[tuple[float, int]] = deque()
        self._overlay_lock = threading.Lock()

    @property
    def next_row(self) -> int:
        """The row the next new version gets."""
        return self._next_row

    def version_of(self, passage_id: str) -> Version | None:
        """Where ``passage_id`` stands (row None once deleted), None when it is not known."""
        return self._current.get(passage_id)

    def row_of(self, passage_id: str) -> int:
        """The row of ``passage_id``'s current version; NotFoundError once deleted or unknown."""
        found = self.version_of(passage_id)
        if found is None or found.row is None:
            raise NotFoundError(f"unknown document id {passage_id!r}")
        return found.row

    def _take(
        self,
        rows: Iterable[tuple[int, OverlayRow]],
        current: Iterable[tuple[str, Version]],
        retired: Sequence[int],
        next_row: int,
    ) -> None:
        """Memory takes a committed change by plain assignments (the caller holds :attr:`_overlay_lock`):
        its new rows, where each id stands now, the rows it retired (dropped after the grace)."""
        for row, entry in rows:
            self._rows[row] = entry
        for passage_id, version in current:
            self._current[passage_id] = version
        now = time.monotonic()
        self._retired.extend((now, row) for row in retired)
        self._next_row = next_row

    def drop_retired(self, now: float | None = None) -> int:
        """Drop the versions retired over :data:`RETIRED_GRACE_S` ago from memory and their KV from
        the document-KV store; returns how many. Run after each change (so memory holds what the
        last grace period before the last change retired), or by a caller that wants them gone."""
        now = time.monotonic() if now is None else now
        rows: list[int] = []
        with self._overlay_lock:
            while self._retired and now - self._retired[0][0] >= self._grace_s:
                rows.append(self._retired.popleft()[1])
            segments = self._segments_of(rows)
            for row in rows:
                self._rows.pop(row, None)
        self._purge_document_kv(segments)
        return len(rows)

    def _segments_of(self, rows: Iterable[int]) -> list[bytes]:
        """The token bytes of each of ``rows``' segments (what a document-KV entry is keyed by),
        where there is a document-KV store; a row that cannot be read has no entry to find."""
        if self.document_kv_dir is None:
            return []
        segments = []
        for row in rows:
            try:
                segments.append(np.asarray(self.tokens(row), dtype=TOKEN_DTYPE).tobytes())
            except (InvalidInputError, ArtifactError):
                continue
        return [segment for segment in segments if segment]

    def _purge_document_kv(self, token_blobs: Sequence[bytes]) -> None:
        """Remove the document-KV entries of these segments (retired versions), where there is a store."""
        if self.document_kv_dir is None or not token_blobs:
            return
        from specrag.pipeline.document_kv.store import purge_segments, segment_key  # torch: only when used

        keys = [segment_key(np.frombuffer(blob, dtype=TOKEN_DTYPE).tolist()) for blob in token_blobs]
        try:
            purge_segments(self.document_kv_dir, keys)
        except OSError as error:
            logger.warning("could not remove retired documents' KV from %s: %s", self.document_kv_dir, error)

    def __len__(self) -> int:
        return self._next_row

    def _check_row(self, row: int) -> None:
        if row not in self._rows and not 0 <= row < self._base_rows:
            raise InvalidInputError(f"passage row {row} out of range [0, {self._next_row}) or retired")

    def tokens(self, row: int) -> tuple[int, ...]:  # type: ignore[override]  # the base's is cached
        live = self._rows.get(row)
        return live.tokens if live is not None else super().tokens(row)

    def passage(self, row: int) -> Passage:  # type: ignore[override]  # the base's is cached
        live = self._rows.get(row)
        return live.passage if live is not None else super().passage(row)
