"""The documents API over a corpus whose durable record is a PostgreSQL table (``--backend pgvector``).

The live corpus (:mod:`~specrag.pipeline.store.live_corpus`) logs a change to its own SQLite log
before it is answered; here the table is the record, so a change is written to the table in one
transaction (:class:`~specrag.retrieval.backends.pgvector.writes.TableWriter`) and answered only after its
COMMIT, and there is no second log to keep in step with it. What stays the same is the rule that
keeps every cached form right: a new version gets a new row, and a row names one version of one
document for as long as the process serves. The new row's prompt segment is tokenized with its own
row label (so the knowledge tree and the document-KV store, keyed by row and by tokens, never take
one version for another); the searcher names the row by the table's (id, version)
(:meth:`~specrag.retrieval.backends.pgvector.searcher.PgVectorSearcher.map_rows`), so a search whose snapshot
was taken before the COMMIT still finds the version it read, and the index hides the replaced row
from every search that starts after (:meth:`~specrag.retrieval.vector_index.VectorIndex.apply_prepared`,
the lexical channel with it).

The live store cannot hold these rows as they are: it is its log (the writer's lock, the commit and
the replay at start are the log's), and a table's rows are read from the table at each start, so
the rows written since start live in memory only (:class:`TableRows`), over the store built from
the rows read at start; a replaced version stays readable for
:data:`~specrag.pipeline.store.overlay_store.RETIRED_GRACE_S` for a query that read it, as in the live
store. A search that reads the index's visibility before a COMMIT and takes its snapshot after it
(before the index's swap, or before the listener shows another writer's change) finds the new
version in its snapshot and shows it as the version its visibility holds
(:meth:`~specrag.retrieval.backends.pgvector.searcher.PgVectorSearcher.map_rows` keeps each id's rows): one
version of the document, never none nor two.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specrag.errors import (
    ArtifactError,
    InvalidInputError,
    NotFoundError,
    WritesSuspendedError,
)
from specrag.pipeline.store.document_store import DocumentStore, TokenizeBatch, render_segment
from specrag.pipeline.store.live_checkpoint import EMBEDDER_AGREEMENT, cosine
from specrag.pipeline.store.live_corpus import (
    Document,
    Written,
    check_delete_batch,
    check_put_batch,
    check_segment_lengths,
    current_document,
    indexed_text,
)
from specrag.pipeline.store.overlay_store import (
    BASE_VERSION,
    RETIRED_GRACE_S,
    OverlayRow,
    OverlayStore,
    Version,
)
from specrag.retrieval.backends.pgvector.changes import ChangeListener, TableRow, read_rows_of, read_versions
from specrag.retrieval.backends.pgvector.searcher import PgVectorSearcher
from specrag.retrieval.backends.pgvector.writes import RowWrite, TableWriter
from specrag.retrieval.corpus import Passage
from specrag.retrieval.vector_index import PreparedChanges, VectorIndex

__all__ = ["TableCorpus", "TableRows", "open_table_corpus"]

logger = logging.getLogger(__name__)


class TableRows(OverlayStore):
    """The rows read from the table at start (a built store) and the versions written since (in
    memory), read as one store; ``keys`` are the start rows' (id, version), in row order."""

    def __init__(
        self,
        path: Path,
        keys: Sequence[tuple[str, int]],
        *,
        document_kv_dir: Path | None = None,
        retired_grace_s: float = RETIRED_GRACE_S,
    ) -> None:
        super().__init__(path, document_kv_dir=document_kv_dir, retired_grace_s=retired_grace_s)
        if len(keys) != self.info.passages:
            raise ArtifactError(f"the store {path} has {self.info.passages} rows, the table {len(keys)}")
        self._current = {passage_id: Version(row, version) for row, (passage_id, version) in enumerate(keys)}

    def held(self) -> dict[str, Version]:
        """Where each id this process saw stands (a copy)."""
        with self._overlay_lock:
            return dict(self._current)

    def install(
        self,
        first_row: int,
        rows: Sequence[OverlayRow],
        current: Sequence[tuple[str, Version]],
        retired: Sequence[int],
    ) -> None:
        """Take a committed change: new rows from ``first_row`` (skipped when held already), where
        each id stands now, and the rows it retired (dropped after the grace period; their
        document KV removed at once)."""
        with self._overlay_lock:
            if self._next_row == first_row:
                added = list(enumerate(rows, start=first_row))
            elif self._next_row == first_row + len(rows):
                added = []
            else:
                raise ArtifactError(
                    f"the store holds rows up to {self._next_row}, the change adds from {first_row}"
                )
            self._take(added, current, retired, first_row + len(rows))
            segments = self._segments_of(retired)
        self._purge_document_kv(segments)
        self.drop_retired()


@dataclass(frozen=True)
class _Change:
    """A change committed to the table, to be shown: what each layer in memory takes of it."""

    prepared: PreparedChanges
    rows: tuple[OverlayRow, ...]
    current: tuple[tuple[str, Version], ...]

    @property
    def keys(self) -> list[tuple[str, int]]:
        """The table's (id, version) of each new row, in row order."""
        return [(row.passage.id, row.version) for row in self.rows]


class TableCorpus:
    """Adds, replaces and deletes documents of a served pgvector table (the documents API's
    :class:`~specrag.service.http.documents.DocumentCorpus`)."""

    def __init__(
        self, store: TableRows, index: VectorIndex, writer: TableWriter, tokenize_batch: TokenizeBatch
    ) -> None:
        if not isinstance(index.searcher, PgVectorSearcher):
            raise InvalidInputError("a table corpus serves a pgvector index")
        if index.embedder is None:
            raise InvalidInputError("a table corpus embeds its documents: the index needs its embedder")
        if len(store) != index.searcher.next_row:
            raise ArtifactError(f"the store has {len(store)} rows and the table {index.searcher.next_row}")
        self.store = store
        self.index = index
        self.searcher: PgVectorSearcher = index.searcher
        self.writer = writer
        self._tokenize_batch = tokenize_batch
        self._lock = threading.Lock()
        self._pending: list[_Change] = []  # committed, not shown yet (showing failed), in order
        self._suspended: str | None = None
        #: The thread that shows other writers' changes (None: they are seen at the next start).
        self.listener: ChangeListener | None = None
        #: The most tokens a document's prompt segment may have (None: no limit), as the live corpus's.
        self.segment_token_limit: int | None = None

    def get(self, passage_id: str) -> Document:
        return current_document(self.store, passage_id)

    @property
    def suspended(self) -> str | None:
        """Why the corpus takes no writes now (a committed change it could not show yet), or None."""
        return self._suspended

    def catch_up(self) -> bool:
        with self._lock:
            return self._catch_up()

    def put(self, passages: Sequence[Passage]) -> list[Written]:
        """Write each of ``passages`` (ids distinct) to the table in one transaction; every search
        that starts after this returns finds the new versions."""
        check_put_batch(passages)
        embedder = self.index.embedder
        assert embedder is not None
        texts = [indexed_text(passage) for passage in passages]
        vectors = np.asarray(embedder.embed(texts), dtype=np.float32)
        with self._lock:
            self._take_writes()
            first = self.store.next_row
            template = self.store.info.segment_template
            tokens = self._tokenize_batch(
                [render_segment(first + at, passage, template) for at, passage in enumerate(passages)]
            )
            check_segment_lengths(passages, tokens, self.segment_token_limit)
            writes, retired, written, keys, current = [], [], [], [], []
            for passage, vector in zip(passages, vectors, strict=True):
                before = self.store.version_of(passage.id)
                version = BASE_VERSION if before is None else before.version + 1
                held = None if before is None or before.row is None else before.version
                if before is not None and before.row is not None:
                    retired.append(before.row)
                writes.append(RowWrite(passage, vector, version, held))
                written.append(Written(passage.id, version, held is None))
                keys.append((passage.id, version))
                current.append((passage.id, Version(first + len(keys) - 1, version)))
            prepared = self.index.prepare_changes([p.id for p in passages], vectors, texts, retired)
            if prepared.first_row != first:
                raise ArtifactError(f"the index shows {prepared.first_row} rows, the store {first}")
            self.writer.write(writes)  # committed from here on: the table is the record
            if not self._shown(_Change(prepared, _new_rows(passages, keys, tokens), tuple(current))):
                return [Written(w.id, w.version, w.created, visible=False) for w in written]
        return written

    def delete(self, passage_ids: Sequence[str]) -> bool:
        """Delete each of ``passage_ids`` from the table in one transaction; NotFoundError (and
        nothing deleted) if one is unknown. Returns whether searches see the deletion yet."""
        check_delete_batch(passage_ids)
        with self._lock:
            self._take_writes()
            deleted, retired, current = [], [], []
            for passage_id in dict.fromkeys(passage_ids):
                before = self.store.version_of(passage_id)
                if before is None or before.row is None:
                    raise NotFoundError(f"unknown document id {passage_id!r}")
                retired.append(before.row)
                deleted.append((passage_id, before.version))
                # The next version of the id is counted on from here, never given twice.
                current.append((passage_id, Version(None, before.version + 1)))
            prepared = self.index.prepare_changes([], np.zeros((0, self.index.dim), np.float32), [], retired)
            self.writer.write([], deleted)
            return self._shown(_Change(prepared, (), tuple(current)))

    def apply_table_changes(self, ids: Iterable[str] | None = None) -> int:
        """Show the rows other writers changed in the table: those of ``ids`` (heard of from the
        change trigger), or every row whose (id, version) differs from what this process holds
        (None: a reconcile, after a time nobody listened). Each is applied as the documents API's
        own writes are: a new version gets a new row (its prompt segment tokenized with its own row
        label, so no cached form is shared with the old one), the old row hidden; a row gone from
        the table is hidden; a row whose new text kept the former text's embedding is embedded
        anew (:meth:`_reembed_stale`). Returns how many ids changed; WritesSuspendedError while a
        committed change of its own could not be shown yet."""
        with self._lock:
            self._take_writes()
            held = self.store.held()
            database = self.searcher.database
            if ids is None:
                table = read_versions(database)
                changed = [i for i, version in table.items() if _differs(held.get(i), version)]
                changed += [i for i, where in held.items() if where.row is not None and i not in table]
            else:
                changed = list(dict.fromkeys(ids))
            found = read_rows_of(database, changed)
            reembedded = self._reembed_stale(held, found)
            passages, keys, retired, current = [], [], [], []
            first = self.store.next_row
            for passage_id in changed:
                before = held.get(passage_id)
                row = found.get(passage_id)
                if row is None:
                    if before is not None and before.row is not None:
                        retired.append(before.row)
                        current.append((passage_id, Version(None, before.version + 1)))
                    continue
                version = reembedded.get(passage_id, row.version)
                if not _differs(before, version):
                    continue  # this process's own write, or one already shown
                if before is not None and before.row is not None:
                    retired.append(before.row)
                passages.append(Passage(passage_id, row.title, row.text))
                keys.append((passage_id, version))
                current.append((passage_id, Version(first + len(keys) - 1, version)))
            if not current:
                return 0
            template = self.store.info.segment_template
            segments = [render_segment(first + at, passage, template) for at, passage in enumerate(passages)]
            tokens = self._tokenize_batch(segments) if segments else []
            texts = [indexed_text(passage) for passage in passages]
            # The table holds the vectors the searcher ranks by: the index takes none of them.
            vectors = np.zeros((len(passages), self.index.dim), np.float32)
            prepared = self.index.prepare_changes([p.id for p in passages], vectors, texts, retired)
            self._shown(_Change(prepared, _new_rows(passages, keys, tokens), tuple(current)))
            logger.info("showed %d rows changed in the table by another writer", len(current))
            return len(current)

    def _reembed_stale(self, held: dict[str, Version], found: dict[str, TableRow]) -> dict[str, int]:
        """Embed anew the rows another writer gave a new text (or title) but left the embedding
        of the one before, and write the vectors back (their own transaction, the next version);
        returns each such id's new version.

        A row's embedding is taken as stale when the service's embedder, given the version it
        held, makes that very vector again (:data:`EMBEDDER_AGREEMENT`, the check the live log
        makes at start): the vector is the former text's, and the service's embedder is the one
        that made it, so its vector of the new text is the right one. A row whose vector it does
        not make (another embedder's) keeps the table's: the other writer owns it."""
        embedder = self.index.embedder
        assert embedder is not None
        changed = []
        for passage_id, row in found.items():
            before = held.get(passage_id)
            if (
                before is None
                or before.row is None
                or row.embedding is None
                or not _differs(before, row.version)
            ):
                continue
            former, now = self.store.passage(before.row), Passage(passage_id, row.title, row.text)
            if indexed_text(former) != indexed_text(now):
                changed.append((passage_id, row, former, now))
        if not changed:
            return {}
        again = np.asarray(embedder.embed([indexed_text(former) for _, _, former, _ in changed]), np.float32)
        stale = [
            (passage_id, row, now)
            for (passage_id, row, _, now), vector in zip(changed, again, strict=True)
            if row.embedding is not None and cosine(vector, row.embedding) >= EMBEDDER_AGREEMENT
        ]
        if not stale:
            return {}
        vectors = np.asarray(embedder.embed([indexed_text(now) for _, _, now in stale]), np.float32)
        written = self.writer.reembed(
            [
                (passage_id, row.version, vector)
                for (passage_id, row, _), vector in zip(stale, vectors, strict=True)
            ]
        )
        logger.info(
            "embedded anew %d rows another writer changed the text of, not the embedding", len(written)
        )
        return {passage_id: row.version + 1 for passage_id, row, _ in stale if passage_id in written}

    def _take_writes(self) -> None:
        if self._pending and not self._catch_up():
            raise WritesSuspendedError(
                f"the corpus takes no writes until it has shown a committed change: {self._suspended}"
            )

    def _shown(self, change: _Change) -> bool:
        self._pending.append(change)
        return self._catch_up()

    def _catch_up(self) -> bool:
        """Show the committed changes in order: the searcher's names for the new rows, the
        store's rows, then the index's swap; each step skips what it did already."""
        while self._pending:
            change = self._pending[0]
            first = change.prepared.first_row
            try:
                if self.searcher.next_row == first:
                    self.searcher.map_rows(change.keys, first)
                self.store.install(first, change.rows, change.current, change.prepared.retired)
                self.index.apply_prepared(change.prepared)
            except Exception as error:  # committed to the table: it must be shown, not dropped
                self._suspended = f"showing a committed change failed: {error!r}"
                logger.exception("a change committed to the table could not be shown; writes suspended")
                return False
            self._pending.pop(0)
        self._suspended = None
        return True


def _new_rows(
    passages: Sequence[Passage], keys: Sequence[tuple[str, int]], tokens: Sequence[Sequence[int]]
) -> tuple[OverlayRow, ...]:
    """The store's new rows: each passage with its segment's tokens and its table version."""
    return tuple(
        OverlayRow(passage, tuple(ids), version)
        for passage, (_, version), ids in zip(passages, keys, tokens, strict=True)
    )


def _differs(held: Version | None, version: int) -> bool:
    """Whether the table's ``version`` of an id is not the one this process shows."""
    return held is None or held.row is None or held.version != version


def open_table_corpus(
    index: VectorIndex,
    store: DocumentStore,
    tokenize_batch: TokenizeBatch,
    document_kv_dir: Path | None = None,
) -> TableCorpus:
    """The documents API's corpus over ``index`` (a pgvector table's) and ``store`` (its rows read
    at start, which the corpus's own store replaces: ``store`` is closed); ``document_kv_dir`` is
    the document-KV store whose entries of replaced versions are removed. InvalidInputError saying
    why when the table cannot be written (its routes then answer 501 saying so)."""
    searcher = index.searcher
    if not isinstance(searcher, PgVectorSearcher):
        raise InvalidInputError(f"a {searcher.kind} index is not a pgvector table")
    if searcher.documents_off is not None:
        raise InvalidInputError(searcher.documents_off)
    rows = TableRows(store.path, searcher.keys(), document_kv_dir=document_kv_dir)
    store.close()
    corpus = TableCorpus(rows, index, TableWriter(searcher.database), tokenize_batch)
    if searcher.changes_off is None:
        listener = ChangeListener(searcher.database.settings, corpus.apply_table_changes).start()
        searcher.on_close.append(listener.close)
        corpus.listener = listener
    return corpus
