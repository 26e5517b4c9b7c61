"""A PostgreSQL table as the durable record of the served corpus (``--backend pgvector``).

The corpus (:class:`~specrag.pipeline.store.live_corpus.LiveCorpus`) is the live corpus's: only
its record differs. Here the table is the record, so a change is written to the table in one
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

A table's rows are read from the table at each start, so the rows written since start live in
memory only (:class:`TableStore`), over the store built from the rows read at start; a replaced
version stays readable for :data:`~specrag.pipeline.store.overlay_store.RETIRED_GRACE_S` for a query
that read it, as in the live store. A search that reads the index's visibility before a COMMIT and
takes its snapshot after it (before the index's swap, or before the listener shows another
writer's change) finds the new version in its snapshot and shows it as the version its visibility
holds (:meth:`~specrag.retrieval.backends.pgvector.searcher.PgVectorSearcher.map_rows` keeps each id's rows):
one version of the document, never none nor two.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from specrag.errors import ArtifactError, InvalidInputError
from specrag.pipeline.store.document_store import DocumentStore, TokenizeBatch
from specrag.pipeline.store.document_writes import indexed_text
from specrag.pipeline.store.live_checkpoint import EMBEDDER_AGREEMENT, cosine
from specrag.pipeline.store.live_corpus import LiveCorpus
from specrag.pipeline.store.live_log import Change
from specrag.pipeline.store.overlay_store import RETIRED_GRACE_S, OverlayRow, OverlayStore, Version
from specrag.retrieval.backends.pgvector.changes import ChangeListener, TableRow, read_rows_of, read_versions
from specrag.retrieval.backends.pgvector.searcher import PgVectorSearcher, served_table
from specrag.retrieval.backends.pgvector.writes import RowWrite, TableWriter
from specrag.retrieval.corpus import Passage
from specrag.retrieval.embedders.embedder import Embedder
from specrag.retrieval.vector_index import VectorIndex

__all__ = ["TableStore", "follow_table", "open_table_corpus"]

logger = logging.getLogger(__name__)


class TableStore(OverlayStore):
    """The rows read from ``searcher``'s table at start (the built store at ``path``) and the
    versions written since (in memory), read as one store; the table is the corpus's
    :class:`~specrag.pipeline.store.live_corpus.DurableRecord`."""

    until_shown = "shown a committed change"
    show_failed = "showing a committed change failed"

    def __init__(
        self,
        path: Path,
        searcher: PgVectorSearcher,
        *,
        document_kv_dir: Path | None = None,
        retired_grace_s: float = RETIRED_GRACE_S,
    ) -> None:
        super().__init__(path, document_kv_dir=document_kv_dir, retired_grace_s=retired_grace_s)
        keys = searcher.keys()
        if len(keys) != self.info.passages:
            raise ArtifactError(f"the store {path} has {self.info.passages} rows, the table {len(keys)}")
        self._current = {passage_id: Version(row, version) for row, (passage_id, version) in enumerate(keys)}
        self.searcher = searcher
        self.writer = TableWriter(searcher.database)
        #: The thread that shows other writers' changes (None: they are seen at the next start).
        self.listener: ChangeListener | None = None

    def held(self) -> dict[str, Version]:
        """Where each id this process saw stands (a copy)."""
        with self._overlay_lock:
            return dict(self._current)

    def commit(self, changes: Sequence[Change]) -> None:
        """Write ``changes`` to the table in one transaction, committed when this returns
        (ConflictError, nothing written, when another writer changed one of them first)."""
        writes, deleted = [], []
        for change in changes:
            before = self.version_of(change.id)
            held = None if before is None or before.row is None else before.version
            if change.passage is None:
                assert held is not None
                deleted.append((change.id, held))
            else:
                assert change.vector is not None
                writes.append(RowWrite(change.passage, change.vector, change.version, held))
        self.writer.write(writes, deleted)

    def show(self, first_row: int, changes: Sequence[Change], retired: Sequence[int]) -> None:
        """Take a committed change: the searcher's names for its new rows (from ``first_row``), the
        rows themselves (skipped when held already), where each id stands now, and the rows it
        retired (dropped after the grace period; their document KV removed at once)."""
        new = [change for change in changes if change.row is not None]
        if self.searcher.next_row == first_row:
            self.searcher.map_rows([(change.id, change.version) for change in new], first_row)
        rows = [OverlayRow(c.passage, c.tokens, c.version) for c in new if c.passage is not None]
        with self._overlay_lock:
            if self._next_row == first_row:
                added = list(enumerate(rows, start=first_row))
            elif self._next_row == first_row + len(rows):
                added = []
            else:
                raise ArtifactError(
                    f"the store holds rows up to {self._next_row}, the change adds from {first_row}"
                )
            current = [(change.id, Version(change.row, change.version)) for change in changes]
            self._take(added, current, retired, first_row + len(rows))
            segments = self._segments_of(retired)
        self._purge_document_kv(segments)
        self.drop_retired()

    def changed(self, embedder: Embedder, ids: Iterable[str] | None) -> list[tuple[str, Passage | None, int]]:
        """The rows other writers changed in the table, as
        :meth:`~specrag.pipeline.store.live_corpus.LiveCorpus.follow` reads them: those of ``ids``
        (heard of from the change trigger), or every row whose (id, version) differs from what
        this process holds (None: a reconcile, after a time nobody listened). A row gone from the
        table is gone (its next version counted on); a row whose new text kept the former text's
        embedding is embedded anew first (:meth:`_reembed_stale`)."""
        held = self.held()
        if ids is None:
            table = read_versions(self.searcher.database)
            changed = [i for i, version in table.items() if _differs(held.get(i), version)]
            changed += [i for i, where in held.items() if where.row is not None and i not in table]
        else:
            changed = list(dict.fromkeys(ids))
        found = read_rows_of(self.searcher.database, changed)
        reembedded = self._reembed_stale(embedder, held, found)
        differing: list[tuple[str, Passage | None, int]] = []
        for passage_id in changed:
            before, row = held.get(passage_id), found.get(passage_id)
            if row is None:
                if before is not None and before.row is not None:
                    differing.append((passage_id, None, before.version + 1))
                continue
            version = reembedded.get(passage_id, row.version)
            if _differs(before, version):  # not this process's own write, nor one shown already
                differing.append((passage_id, Passage(passage_id, row.title, row.text), version))
        return differing

    def _reembed_stale(
        self, embedder: Embedder, held: dict[str, Version], found: dict[str, TableRow]
    ) -> dict[str, int]:
        """Embed anew the rows another writer gave a new text (or title) but left the embedding
        of the one before, and write the vectors back (their own transaction, the next version);
        returns each such id's new version.

        A row's embedding is taken as stale when the service's embedder, given the version it
        held, makes that very vector again (:data:`EMBEDDER_AGREEMENT`, the check the live log
        makes at start): the vector is the former text's, and the service's embedder is the one
        that made it, so its vector of the new text is the right one. A row whose vector it does
        not make (another embedder's) keeps the table's: the other writer owns it."""
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
            former, now = self.passage(before.row), Passage(passage_id, row.title, row.text)
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


def _differs(held: Version | None, version: int) -> bool:
    """Whether the table's ``version`` of an id is not the one this process shows."""
    return held is None or held.row is None or held.version != version


def follow_table(corpus: LiveCorpus[TableStore], ids: Iterable[str] | None = None) -> int:
    """Show the rows other writers changed in the table (:meth:`TableStore.changed`) as the
    corpus's own writes are shown; returns how many ids changed (what the listener calls)."""
    embedder = corpus.index.embedder
    assert embedder is not None  # a live corpus's index has one
    shown = corpus.follow(lambda: corpus.store.changed(embedder, ids))
    if shown:
        logger.info("showed %d rows changed in the table by another writer", shown)
    return shown


def open_table_corpus(
    index: VectorIndex,
    store: DocumentStore,
    tokenize_batch: TokenizeBatch,
    document_kv_dir: Path | None = None,
) -> LiveCorpus[TableStore]:
    """The documents API's corpus over ``index`` (a pgvector table's) and ``store`` (its rows read
    at start, which the corpus's own store replaces: ``store`` is closed); ``document_kv_dir`` is
    the document-KV store whose entries of replaced versions are removed. InvalidInputError saying
    why when the table cannot be written (its routes then answer 501 saying so)."""
    searcher = served_table(index.searcher)
    if searcher.documents_off is not None:
        raise InvalidInputError(searcher.documents_off)
    rows = TableStore(store.path, searcher, document_kv_dir=document_kv_dir)
    store.close()
    corpus = LiveCorpus(rows, index, tokenize_batch, compact_share=None)
    if searcher.changes_off is None:
        listener = ChangeListener(searcher.database.settings, functools.partial(follow_table, corpus)).start()
        searcher.on_close.append(listener.close)
        rows.listener = listener
    return corpus
