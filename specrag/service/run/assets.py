"""Build whatever the embedded default is missing: corpus, model, document store, index.

Each step is skipped when its artefact exists and matches what it is built from (the corpus
checksum, the tokenizer fingerprint, the model's manifest), so the README's commands are
idempotent and a second run starts at once. Each step holds its artefact's writer lock from the
check to the write, so a second ``prepare`` or ``serve`` on the same data directory waits and then
finds the artefact built. A corpus that differs from the one the artefacts were built from is
said at WARNING, and one that lost passages is refused unless accepted
(:mod:`specrag.retrieval.corpus_change`). Lives in the service because it combines retrieval
(corpus, index) with the pipeline (model, tokenizer, store).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from specrag.errors import ArtifactError, InvalidInputError
from specrag.locking import writer_lock
from specrag.paths import DataLayout
from specrag.pipeline.models.catalog import resolve_model
from specrag.pipeline.models.tokenizer import Tokenizer
from specrag.pipeline.store.document_store import (
    DEFAULT_SEGMENT_TEMPLATE,
    DocumentStore,
    build_store,
    corpus_checksum,
)
from specrag.pipeline.store.live_corpus import LiveCorpus
from specrag.pipeline.store.live_store import LiveStore
from specrag.retrieval.backends.contract import OpenedIndex
from specrag.retrieval.backends.registry import Chosen, data_directory
from specrag.retrieval.corpus import Passage, build_default_corpus, load_passages, write_passages
from specrag.retrieval.corpus_change import CorpusShrunkError, check_corpus_change
from specrag.retrieval.embedders.http_embedder import OpenAIEmbedder
from specrag.retrieval.embedders.served import ServedEmbedder, served_mismatch
from specrag.retrieval.index_store import (
    IndexConfig,
    build_index,
    built_corpus_checksum,
    built_passage_ids,
    check_corpus,
    load_index,
    recorded_embedder,
    save_index,
)
from specrag.retrieval.vector_index import VectorIndex

__all__ = [
    "Assets",
    "CheckingAssets",
    "check_assets_in_background",
    "ensure_assets",
    "ensure_corpus",
    "ensure_index",
    "ensure_store",
]

logger = logging.getLogger(__name__)


@dataclass
class Assets:
    """Everything a query needs besides the engine, loaded and checked against each other."""

    passages: list[Passage]
    model_dir: Path
    tokenizer: Tokenizer
    store: DocumentStore
    index: VectorIndex
    corpus: LiveCorpus | None = None
    """The documents changed since the build (``specrag documents``, ``/v1/documents``), replayed
    onto ``store`` and ``index``, or a table's documents API written through to it; None for assets
    assembled without it (a test's, a table this user may not write)."""
    documents_off: str | None = None
    """Why the documents API is off when ``corpus`` is None (its routes answer 501 saying so)."""
    opened: OpenedIndex | None = None
    """The backend's opened index: what to let go of when the service stops (a database's
    connections) and the backend's part of ``/health``; None for assets assembled without one."""

    def close(self) -> None:
        """Let go of what the index holds outside this process (idempotent enough: called once)."""
        if self.opened is not None:
            self.opened.close()


def ensure_corpus(
    layout: DataLayout, corpus_file: Path | None = None, accept_corpus_change: bool = False
) -> list[Passage]:
    """Load ``corpus_file`` (a user's JSONL), or the data directory's corpus, building the default
    one if there is none.

    A user's corpus is copied into the data directory: the random model's tokenizer is trained on
    it, so a later command on the same data directory without ``--corpus`` must keep using it, not
    silently rebuild the store and index from the default corpus. Either corpus is first compared
    with the one the data directory's index was built from (refused if it lost passages, unless
    ``accept_corpus_change``), so that a refused corpus replaces nothing, not even the copy.
    """
    with writer_lock(layout.corpus_file):
        if corpus_file is not None:
            passages = load_passages(corpus_file)
            _compare_with_index(layout, passages, accept_corpus_change)
            if corpus_file.resolve() != layout.corpus_file.resolve():
                write_passages(layout.corpus_file, passages)
                logger.info("recorded the corpus %s in %s", corpus_file, layout.corpus_file)
            return passages
        if not layout.corpus_file.is_file():
            count = write_passages(layout.corpus_file, build_default_corpus())
            logger.info("built the default corpus: %d passages in %s", count, layout.corpus_file)
        passages = load_passages(layout.corpus_file)
        _compare_with_index(layout, passages, accept_corpus_change)
        return passages


def _compare_with_index(layout: DataLayout, passages: list[Passage], accept_corpus_change: bool) -> None:
    built_ids = built_passage_ids(layout.index_dir)
    if built_ids is not None:
        check_corpus_change(f"the index {layout.index_dir}", built_ids, passages, accept_corpus_change)


def ensure_store(
    layout: DataLayout, passages: list[Passage], tokenizer: Tokenizer, accept_corpus_change: bool = False
) -> DocumentStore:
    """The document store for this tokenizer and corpus, tokenizing the corpus if needed.

    A store built from another corpus is compared with this one first (see :func:`ensure_corpus`).
    """
    path = layout.store_file(tokenizer.fingerprint)
    checksum = corpus_checksum(passages)
    with writer_lock(path):
        if not path.exists():
            logger.info("building the document store %s", path)
        else:
            try:
                store = DocumentStore(path)
                if store.info.corpus_checksum != checksum:
                    check_corpus_change(
                        f"the document store {path}", store.passage_ids(), passages, accept_corpus_change
                    )
                store.check_matches(tokenizer.fingerprint, checksum, DEFAULT_SEGMENT_TEMPLATE)
                logger.debug("document store %s: %d tokens, up to date", path, store.info.total_tokens)
                return store
            except CorpusShrunkError:
                raise
            except ArtifactError as reason:
                logger.warning("rebuilding the document store %s (%s)", path, reason)
        with tqdm(total=len(passages), desc="tokenizing passages", unit="passage") as bar:
            build_store(
                path,
                passages,
                tokenizer.encode_batch,
                tokenizer.fingerprint,
                progress=lambda done: bar.update(done - bar.n),
            )
        return DocumentStore(path)


def ensure_index(
    layout: DataLayout,
    passages: list[Passage],
    config: IndexConfig | None = None,
    directory: Path | None = None,
    refuse_other_embedder: bool = False,
    shard_vectors: bool = True,
    query_embedder: OpenAIEmbedder | None = None,
) -> VectorIndex:
    """The vector index over ``passages``, built when missing, corrupt, built from another corpus or
    with another embedder or channels than ``config`` (default: the hybrid default).

    It lives in the data directory's index directory unless ``directory`` names another one (a
    benchmark's padded index, whose name must then say what ``config`` it was built with: only the
    corpus is checked against it). With ``refuse_other_embedder`` (serve: ``config`` names the
    query embedder) an index embedded by another embedder, or by other weights of the same one,
    is an InvalidInputError naming both instead of being rebuilt: questions embedded unlike the
    passages would find the wrong ones, and a rebuild is for ``prepare`` to decide. Without
    ``shard_vectors`` a sharded index is held as its shards' manifests (:func:`load_index`), a
    fresh build included: actors search it. A ``query_embedder`` (an embedding server) must serve
    the index's embedder (:func:`~specrag.retrieval.embedders.served.served_mismatch`, refused
    otherwise), embeds an index built here, and then embeds the index's questions and documents.
    """
    directory = directory or layout.index_dir
    config = config or IndexConfig()
    # Questions embedded by a server: the recorded embedder is never loaded in this process.
    served = None if query_embedder is None else functools.partial(ServedEmbedder, query_embedder)
    with writer_lock(directory):
        checksum = corpus_checksum(passages)
        embedded_by = recorded_embedder(directory)
        if query_embedder is not None:
            other_embedder = served_mismatch(embedded_by, query_embedder)
            if other_embedder is not None:
                raise InvalidInputError(f"{directory}: {other_embedder}")
        other_embedder = None if query_embedder else config.embedder_mismatch(embedded_by)
        if other_embedder is not None and refuse_other_embedder:
            raise InvalidInputError(
                f"{directory}: {other_embedder}; serve with the index's embedder (--embedder) or "
                "rebuild the index with `specrag prepare --embedder NAME`"
            )
        try:
            if other_embedder is not None:
                raise ArtifactError(other_embedder)
            index = load_index(directory, shard_vectors=shard_vectors, embedded_by=served)
            check_corpus(index, passages)
            recorded = built_corpus_checksum(directory)
            mismatch = config.mismatch(index)
            if recorded is not None and recorded != checksum:
                mismatch = "built from the same passage ids with other titles or texts"
            if mismatch is None:
                _describe(index, f"loaded the vector index {directory}")
                return index
            logger.warning("rebuilding the vector index in %s (%s)", directory, mismatch)
        except ArtifactError as reason:
            if directory.exists():
                logger.warning("rebuilding the vector index in %s (%s)", directory, reason)
            else:
                logger.info("building the vector index in %s", directory)
        index = build_index(passages, config, query_embedder, progress=True)
        save_index(index, directory, checksum)
        if not shard_vectors:
            index = load_index(directory, shard_vectors=False, embedded_by=served)
        _describe(index, f"built the vector index {directory}")
        return _served_after_build(index, query_embedder, directory)


def _served_after_build(index: VectorIndex, server: OpenAIEmbedder | None, directory: Path) -> VectorIndex:
    """``index`` as built by ``server`` (if any), its questions and added documents embedded by it
    under the embedder the index records, as a loaded index is given them (:func:`load_index`)."""
    if server is not None and index.embedder is server:
        recorded = recorded_embedder(directory)
        assert recorded is not None, "the index was just saved with its embedder"
        index.embedder = ServedEmbedder(server, recorded)
    return index


def _describe(index: VectorIndex, what: str) -> None:
    logger.debug("%s: %s, %d rows × %d dims", what, index.searcher.settings, index.searcher.ntotal, index.dim)


@dataclass(frozen=True)
class _DataDirectory:
    """The data directory's corpus and index, as a backend that keeps its index there opens them
    (:class:`~specrag.retrieval.backends.contract.DataDirectory`)."""

    layout: DataLayout
    corpus_file: Path | None
    accept_corpus_change: bool
    refuse_other_embedder: bool

    def passages(self) -> list[Passage]:
        return ensure_corpus(self.layout, self.corpus_file, self.accept_corpus_change)

    def index(
        self,
        passages: list[Passage],
        config: IndexConfig,
        shard_vectors: bool,
        query_embedder: OpenAIEmbedder | None = None,
    ) -> VectorIndex:
        return ensure_index(
            self.layout,
            passages,
            config,
            refuse_other_embedder=self.refuse_other_embedder,
            shard_vectors=shard_vectors,
            query_embedder=query_embedder,
        )


def ensure_assets(
    layout: DataLayout,
    model: str | Path | None = None,
    corpus_file: Path | None = None,
    accept_corpus_change: bool = False,
    backend: Chosen[Any] | None = None,
    refuse_other_embedder: bool = False,
    on_model: Callable[[Path], None] | None = None,
) -> Assets:
    """Corpus, model, tokenizer, store and index, each built only if missing or stale.

    ``backend`` is the retrieval backend the command line chose
    (:func:`specrag.retrieval.backends.registry.chosen`; None: the data directory's index with
    the default embedder): it opens the passages and the index (a table's rows are its passages:
    ``corpus_file`` is then not read). ``model`` is a model name (None: the default,
    SmolLM2-135M-Instruct) or a model directory
    (:func:`specrag.pipeline.models.catalog.resolve_model`). A corpus that lost passages since the
    store and index were built is refused unless ``accept_corpus_change``;
    ``refuse_other_embedder`` is :func:`ensure_index`'s. ``on_model`` is told the model directory
    as soon as it is verified, before the other artefacts are: all an engine needs to start
    (:func:`check_assets_in_background`).
    """
    directory = _DataDirectory(layout, corpus_file, accept_corpus_change, refuse_other_embedder)
    opened = (backend or data_directory()).open(directory)
    try:
        passages = opened.passages
        resolved_model = resolve_model(layout, model, (passage.text for passage in passages))
        if on_model is not None:
            on_model(resolved_model)
        tokenizer = Tokenizer(resolved_model)
        if opened.store_name is None:
            base = ensure_store(layout, passages, tokenizer, accept_corpus_change)
        else:  # rows that live elsewhere: a store of their own, and lost rows are their owner's doing
            own = DataLayout(layout.root / "external" / opened.store_name)
            base = ensure_store(own, passages, tokenizer, accept_corpus_change=True)
        index = opened.index()
        corpus, store, documents_off = _documents(opened, layout, base, index, tokenizer)
    except BaseException:
        opened.close()
        raise
    logger.debug("assets ready: %d passages, model %s", len(passages), resolved_model)
    return Assets(
        passages=passages,
        model_dir=resolved_model,
        tokenizer=tokenizer,
        store=store,
        index=index,
        corpus=corpus,
        documents_off=documents_off,
        opened=opened,
    )


def _documents(
    opened: OpenedIndex, layout: DataLayout, base: DocumentStore, index: VectorIndex, tokenizer: Tokenizer
) -> tuple[LiveCorpus | None, DocumentStore, str | None]:
    """The documents API's corpus over ``index`` and the store it keeps (which replaces ``base``),
    or None and why the API is off: the table's corpus when the opened index says its table is
    the documents' record, else the data directory's log replayed onto the index."""
    if opened.table is None:
        base.close()
        live = LiveStore(base.path, data_dir=layout.root, document_kv_dir=layout.document_kv_dir)
        corpus = LiveCorpus.replayed(live, index, tokenizer.encode_batch)
        return corpus, corpus.store, None
    from specrag.pipeline.store.table_corpus import open_table_corpus

    try:
        table = open_table_corpus(index, base, tokenizer.encode_batch, layout.document_kv_dir)
    except InvalidInputError as reason:
        documents_off = f"{opened.documents_off} ({reason})"
        logger.warning("the documents API is off: %s", documents_off)
        return None, base, documents_off
    return table, table.store, None


@dataclass(frozen=True)
class CheckingAssets:
    """Assets whose model directory is verified while the other artefacts are still being checked
    (``checked``: the task that ends with them): an engine can start from ``model_dir`` meanwhile."""

    model_dir: Path
    checked: asyncio.Future[Assets]

    def close(self) -> None:
        """Close the assets if they were checked (a check that failed or never ended holds none)."""
        if self.checked.done() and not self.checked.cancelled() and self.checked.exception() is None:
            self.checked.result().close()


async def check_assets_in_background(check: Callable[[Callable[[Path], None]], Assets]) -> CheckingAssets:
    """Run ``check`` (:func:`ensure_assets` given its ``on_model``) in a thread, and return as soon
    as it has verified the model directory, the other artefacts still being checked.

    The engine needs only the model directory, and its start is mostly its own processes' work, so
    the tokenizer, the store and the index are checked while it starts. An error before the model
    was verified is raised here, so that no engine starts for it.
    """
    loop = asyncio.get_running_loop()
    verified: asyncio.Future[Path] = loop.create_future()

    def settle(model_dir: Path) -> None:
        if not verified.done():
            verified.set_result(model_dir)

    def verified_in_thread(model_dir: Path) -> None:
        loop.call_soon_threadsafe(settle, model_dir)

    checked = asyncio.ensure_future(asyncio.to_thread(check, verified_in_thread))
    either: list[asyncio.Future[Any]] = [verified, checked]
    await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
    if verified.done():
        return CheckingAssets(verified.result(), checked)
    return CheckingAssets((await checked).model_dir, checked)  # raises the check's error
