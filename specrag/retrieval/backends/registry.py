"""The retrieval backends, each registered once, and the one lookup from a command line to one.

Adding a backend is a folder of its own under ``retrieval/backends/`` (its staged searcher, its
flags, its build and open) and one :class:`~specrag.retrieval.backends.contract.Backend` in
:data:`BACKENDS` below: ``--backend``'s choices, the flags of ``index build`` and ``serve``, what
a command line may combine, the build and the service's assets all come from here
(:func:`chosen`), and nothing else names a backend. The index facade is put around a backend's
searcher here, so that no backend imports it.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from specrag.errors import InvalidInputError
from specrag.retrieval.backends.contract import (
    BROUGHT_EMBEDDERS,
    Backend,
    BuildRequest,
    DataDirectory,
    EmbedderChoice,
    Flags,
    OpenedIndex,
)
from specrag.retrieval.backends.pgvector import settings as table
from specrag.retrieval.backends.pgvector.flags import add_arguments as add_table_arguments
from specrag.retrieval.corpus import Passage
from specrag.retrieval.embedders.embedder import Embedder
from specrag.retrieval.index_store import (
    EMBEDDER_ENV,
    MINILM,
    WORDLLAMA,
    IndexConfig,
    build_index,
    default_embedder,
    save_index,
)
from specrag.retrieval.progress import embed_in_batches
from specrag.retrieval.search.stages import DEFAULT_STAGES, StagedSearcher
from specrag.retrieval.vector_index import VectorIndex

if TYPE_CHECKING:  # the database driver is imported only when a table is built or opened
    from specrag.retrieval.backends.pgvector.assembly import OpenTable

__all__ = [
    "BACKENDS",
    "LOCAL",
    "PGVECTOR",
    "QUERY_EMBEDDERS",
    "SHARDS",
    "STORES",
    "Chosen",
    "add_arguments",
    "chosen",
    "data_directory",
    "open_table_index",
]

# The built-in embedders a service may embed questions with (TF-IDF's fitted state lives only in
# an index directory, which a served index loads with it).
QUERY_EMBEDDERS = (MINILM, WORDLLAMA)


@dataclass(frozen=True)
class DirectorySettings:
    """An index in the data directory: the built-in embedder that embeds questions (serve) or
    the passages (``index build``, whose flags say how to build it)."""

    embedder: str


def _directory_settings(args: argparse.Namespace, building: bool) -> DirectorySettings:
    if not building and args.embedder not in QUERY_EMBEDDERS:
        raise InvalidInputError(
            f"--embedder {args.embedder} needs --backend pgvector; a local index is embedded by "
            f"{' or '.join(QUERY_EMBEDDERS)} (--embedder or ${EMBEDDER_ENV})"
        )
    return DirectorySettings(args.embedder)


def _no_flags(parser: Flags, building: bool) -> None:
    """The data directory's index has its flags on ``index build`` itself (``--kind``, ...)."""


def _build_directory(settings: DirectorySettings, request: BuildRequest) -> str:
    index = build_index(request.passages, request.config, embedder=request.embedder, progress=True)
    save_index(index, request.output)
    return (
        f"indexed {len(request.passages)} passages ({index.searcher.ntotal} rows, {index.dim} dims, "
        f"{index.searcher.settings}) into {request.output} in {time.perf_counter() - request.started:.1f}s"
    )


@dataclass
class _DirectoryIndex:
    """The data directory's index over its corpus, loaded (built when missing or stale) once the
    model is verified; ``shard_vectors``: a sharded one with its shards' vectors in this process."""

    directory: DataDirectory
    config: IndexConfig
    passages: list[Passage]
    shard_vectors: bool
    store_name: str | None = None
    table: StagedSearcher | None = None
    documents_off: str | None = None

    def index(self) -> VectorIndex:
        return self.directory.index(self.passages, self.config, self.shard_vectors)

    def close(self) -> None:
        """Nothing outside this process (shard actors stop with the service's Ray block)."""

    def health(self, bound_s: float) -> dict[str, Any] | None:
        return None  # the shard actors' health is the service's, which started them


def _open_directory(settings: DirectorySettings, directory: DataDirectory) -> OpenedIndex:
    return _DirectoryIndex(directory, IndexConfig(embedder=settings.embedder), directory.passages(), True)


def _open_shard_manifests(settings: DirectorySettings, directory: DataDirectory) -> OpenedIndex:
    """A sharded index whose shards' actors hold the vectors: this process keeps the manifests."""
    return _DirectoryIndex(directory, IndexConfig(embedder=settings.embedder), directory.passages(), False)


@dataclass(frozen=True)
class TableSettings:
    """A pgvector table: where and how (``serve``), and the embedder questions are embedded with."""

    table: table.PgServing
    embedder: EmbedderChoice


def _table_settings(args: argparse.Namespace, building: bool) -> table.PgBuild | TableSettings:
    if building:
        return table.build_settings(args)
    return TableSettings(table.serve_settings(args), EmbedderChoice.from_args(args))


def _build_table(settings: table.PgBuild | TableSettings, request: BuildRequest) -> str:
    assert isinstance(settings, table.PgBuild), "index build reads the build's settings"
    from specrag.retrieval.backends.pgvector.assembly import build_table, passage_texts

    texts = passage_texts(request.passages)
    if request.embedder is None:
        _, vectors = request.config.fit_and_embed(texts, progress=True)
    else:
        vectors = embed_in_batches(request.embedder, texts, show=True)
    return build_table(settings, request.passages, vectors, request.config.nlist, request.started)


@dataclass
class _TableIndex:
    """A pgvector table opened for serving: its rows are the passages and the documents' record."""

    opened: OpenTable
    vector_index: VectorIndex
    store_name: str
    documents_off: str = table.DOCUMENTS_OFF

    @property
    def passages(self) -> list[Passage]:
        return self.opened.passages

    @property
    def table(self) -> StagedSearcher:
        return self.opened.searcher

    def index(self) -> VectorIndex:
        return self.vector_index

    def close(self) -> None:
        self.opened.searcher.close()

    def health(self, bound_s: float) -> dict[str, Any] | None:
        from specrag.retrieval.backends.pgvector.assembly import database_health

        return database_health(self.opened.searcher, bound_s)


def _table_index(opened: OpenTable) -> VectorIndex:
    return VectorIndex(
        opened.searcher,
        [passage.id for passage in opened.passages],
        embedder=opened.embedder,
        lexical=opened.lexical,
        default_stages=DEFAULT_STAGES["ivf"],
    )


def open_table_index(
    settings: table.PgServing, embedder: Embedder, lexical: bool = True
) -> tuple[VectorIndex, list[Passage]]:
    """The table as an index searched with ``embedder`` (the model that embedded it), and its rows
    as passages; ``lexical=False``: no lexical channel (a test's or benchmark's dense search)."""
    from specrag.retrieval.backends.pgvector.assembly import open_table

    opened = open_table(settings, lambda texts: embedder, lexical)
    return _table_index(opened), opened.passages


def _open_table(settings: table.PgBuild | TableSettings, directory: DataDirectory) -> OpenedIndex:
    assert isinstance(settings, TableSettings), "serve reads the service's settings"
    from specrag.retrieval.backends.pgvector.assembly import open_table

    brought = settings.embedder.brought()  # first: a bad choice fails before the database is reached

    def fit(texts: Sequence[str]) -> Embedder:
        """The brought embedder, else the built-in one fitted on the rows as the build fitted it."""
        return brought or IndexConfig(embedder=settings.embedder.name).fit(texts)

    opened = open_table(settings.table, fit)
    return _TableIndex(opened, _table_index(opened), table.store_name(settings.table.table))


LOCAL: Backend[DirectorySettings] = Backend(
    "local", "local", False, _no_flags, _directory_settings, _build_directory, _open_directory
)
SHARDS: Backend[DirectorySettings] = Backend(
    "shards", "local", True, _no_flags, _directory_settings, _build_directory, _open_shard_manifests
)
PGVECTOR: Backend[table.PgBuild | TableSettings] = Backend(
    "pgvector", "pgvector", False, add_table_arguments, _table_settings, _build_table, _open_table
)
BACKENDS: tuple[Backend[Any], ...] = (LOCAL, SHARDS, PGVECTOR)
"""Every backend, once; the first of those that store alike is the one chosen without shards."""
STORES = tuple(dict.fromkeys(backend.stores for backend in BACKENDS))
"""``--backend``'s choices: where the vectors live."""

S = TypeVar("S")


@dataclass(frozen=True)
class Chosen(Generic[S]):
    """The backend a command line chose, with its settings (checked: nothing refused is left)."""

    backend: Backend[S]
    settings: S

    @property
    def name(self) -> str:
        return self.backend.name

    def build(self, request: BuildRequest) -> str:
        return self.backend.build(self.settings, request)

    def open(self, directory: DataDirectory) -> OpenedIndex:
        return self.backend.open(self.settings, directory)


def chosen(args: argparse.Namespace, building: bool = False) -> Chosen[Any]:
    """The backend ``args`` choose (``index build``'s when ``building``, else a serving command's:
    one without ``--backend`` serves the data directory's index), its settings read and checked
    before anything is touched. Shards (``--search-shards``, ``--shards N``) choose the sharded
    backend of the ``--backend`` named, or are refused by the one that has none."""
    stores = args.backend if "backend" in args else LOCAL.stores
    sharded = args.shards > 1 if building else vars(args).get("search_shards") is not None
    alike = [backend for backend in BACKENDS if backend.stores == stores]
    backend = next((found for found in alike if found.sharded == sharded), alike[0])
    return Chosen(backend, backend.settings(args, building))


def data_directory(embedder: str | None = None) -> Chosen[DirectorySettings]:
    """The data directory's index embedded by ``embedder`` (None: the default): what a caller
    without a serving command line serves (a benchmark's, a test's)."""
    return Chosen(LOCAL, DirectorySettings(embedder or default_embedder()))


def add_arguments(parser: Flags, building: bool) -> None:
    """``--backend`` and every backend's flags (``building``: ``index build``'s, else ``serve``'s,
    with the embedder that embeds questions: index build has its own ``--embedder``)."""
    parser.add_argument(
        "--backend", choices=STORES, default=LOCAL.stores, help="where the vectors live (default: local)"
    )
    if not building:
        _add_query_embedder(parser)
    for backend in BACKENDS:
        backend.add_arguments(parser, building)


def _add_query_embedder(parser: Flags) -> None:
    """What embeds questions: it must be what embedded the index."""
    parser.add_argument(
        "--embedder",
        choices=(*QUERY_EMBEDDERS, *BROUGHT_EMBEDDERS),
        default=default_embedder(),
        help="what embeds questions: what embedded the index, else the service refuses to start "
        f"(default: ${EMBEDDER_ENV}, else {MINILM}, as index build and prepare embed; wordllama is "
        "fitted on the passages as they fit it); sentence-transformers and openai: with --backend pgvector",
    )
    parser.add_argument("--embedder-model", help="model directory, or the model name a server serves")
    parser.add_argument("--embedder-url", help="base URL of an OpenAI-compatible /v1/embeddings server")
    parser.add_argument("--embedder-key-env", help="environment variable holding the server's API key")
