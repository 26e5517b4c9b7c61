"""The retrieval backends, each registered once, and the one lookup from a command line to one.

Adding a backend is a folder of its own under ``retrieval/backends/`` (its staged searcher, its
flags, its settings, its load and its open) and one registration below, in :data:`BACKENDS`
(``searched(...)`` for a backend that keeps its own vectors, as pgvector does): ``--backend``'s
choices, the flags of ``index build`` and ``serve``, what a command line may combine, the build,
the service's assets and ``/health`` all come from here (:func:`chosen`), and nothing else names
a backend. The index facade is put around a backend's searcher here (:func:`around`), so that no
backend imports it.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import numpy as np

from specrag.errors import InvalidInputError
from specrag.retrieval.backends.contract import (
    Backend,
    BuildRequest,
    DataDirectory,
    Embed,
    Fit,
    Flags,
    OpenedIndex,
    OpenedSearcher,
)
from specrag.retrieval.backends.pgvector import backend as pgvector
from specrag.retrieval.backends.pgvector.flags import add_arguments as add_pgvector_arguments
from specrag.retrieval.corpus import Passage
from specrag.retrieval.embedders.choice import (
    BROUGHT_EMBEDDERS,
    DEFAULT_EMBEDDER_TIMEOUT_S,
    SERVED_EMBEDDER,
    EmbedderChoice,
    add_brought_arguments,
)
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

if TYPE_CHECKING:  # aiohttp's client is imported only for a server
    from specrag.retrieval.embedders.http_embedder import OpenAIEmbedder

__all__ = [
    "BACKENDS",
    "LOCAL",
    "PGVECTOR",
    "QUERY_EMBEDDERS",
    "SHARDS",
    "Chosen",
    "DirectorySettings",
    "add_arguments",
    "around",
    "chosen",
    "data_directory",
    "searched",
    "stores",
]

S = TypeVar("S")

# The built-in embedders a service may embed questions with (TF-IDF's fitted state lives only in
# an index directory, which a served index loads with it).
QUERY_EMBEDDERS = (MINILM, WORDLLAMA)


@dataclass(frozen=True)
class DirectorySettings:
    """An index in the data directory: the built-in embedder that embeds questions (serve) or
    the passages (``index build``, whose flags say how to build it); served, ``query_embedder``
    (an embedding server serving the index's model) embeds its questions and documents instead."""

    embedder: str
    query_embedder: OpenAIEmbedder | None = None

    def config(self) -> IndexConfig:
        """The index this data directory should hold (a served embedder's index: the default
        one, checked against the server when loaded)."""
        return IndexConfig() if self.query_embedder is not None else IndexConfig(embedder=self.embedder)


def _directory_settings(args: argparse.Namespace, building: bool) -> DirectorySettings:
    """The data directory's settings: served, its index is embedded by a built-in query embedder
    or by an embedding server serving its model (asked now, so a server that does not answer
    fails the start before anything else is touched)."""
    if building:
        return DirectorySettings(args.embedder)
    if args.embedder == SERVED_EMBEDDER:
        return DirectorySettings(args.embedder, EmbedderChoice.from_args(args).served())
    if args.embedder not in QUERY_EMBEDDERS:
        raise InvalidInputError(
            f"--embedder {args.embedder} needs --backend pgvector; a local index is embedded by "
            f"{' or '.join(QUERY_EMBEDDERS)} (--embedder or ${EMBEDDER_ENV}), or by a server "
            f"serving its model (--embedder {SERVED_EMBEDDER})"
        )
    return DirectorySettings(args.embedder)


def _shard_settings(args: argparse.Namespace, building: bool) -> DirectorySettings:
    """A sharded index's settings; served, its shards are Ray actors: ``--ray``, at least one
    shard and a CPU share Ray can count are needed."""
    if not building:
        if args.ray is None:
            raise InvalidInputError("--search-shards places the shards as Ray actors: give --ray too")
        if args.search_shards < 1:
            raise InvalidInputError(f"--search-shards must be at least 1, got {args.search_shards}")
        if args.search_shard_cpus is not None and not args.search_shard_cpus >= 0:  # NaN fails too
            raise InvalidInputError(f"--search-shard-cpus must be 0 or more, got {args.search_shard_cpus}")
    return _directory_settings(args, building)


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
    query_embedder: OpenAIEmbedder | None = None
    store_name: str | None = None
    table: StagedSearcher | None = None
    documents_off: str | None = None

    def index(self) -> VectorIndex:
        return self.directory.index(self.passages, self.config, self.shard_vectors, self.query_embedder)

    def close(self) -> None:
        """Nothing outside this process (shard actors stop with the service's Ray block)."""

    def health(self, bound_s: float) -> dict[str, Any] | None:
        return None  # the shard actors' health is the service's, which started them


def _open_directory(settings: DirectorySettings, directory: DataDirectory) -> OpenedIndex:
    return _DirectoryIndex(directory, settings.config(), directory.passages(), True, settings.query_embedder)


def _open_shard_manifests(settings: DirectorySettings, directory: DataDirectory) -> OpenedIndex:
    """A sharded index whose shards' actors hold the vectors: this process keeps the manifests."""
    return _DirectoryIndex(directory, settings.config(), directory.passages(), False, settings.query_embedder)


@dataclass
class _SearcherIndex:
    """The index around a backend's own searcher (:class:`OpenedSearcher`), as the service opens it."""

    opened: OpenedSearcher
    vector_index: VectorIndex

    @property
    def passages(self) -> list[Passage]:
        return self.opened.passages

    @property
    def store_name(self) -> str | None:
        return self.opened.store_name

    @property
    def table(self) -> StagedSearcher | None:
        return self.opened.table

    @property
    def documents_off(self) -> str | None:
        return self.opened.documents_off

    def index(self) -> VectorIndex:
        return self.vector_index

    def close(self) -> None:
        self.opened.close()

    def health(self, bound_s: float) -> dict[str, Any] | None:
        return self.opened.health(bound_s)


def around(opened: OpenedSearcher) -> VectorIndex:
    """The index facade around a backend's opened searcher (row i = passage i): stage plan,
    fusion and timeline as on every backend."""
    return VectorIndex(
        opened.searcher,
        [passage.id for passage in opened.passages],
        embedder=opened.embedder,
        lexical=opened.lexical,
        default_stages=DEFAULT_STAGES["ivf"],
    )


def _fit_built_in(name: str, texts: Sequence[str]) -> Embedder:
    return IndexConfig(embedder=name).fit(texts)


def searched(
    name: str,
    stores: str,
    add_arguments: Callable[[Flags, bool], None],
    settings: Callable[[argparse.Namespace, bool], S],
    load: Callable[[S, Sequence[Passage], Embed, int, float], str],
    open_searcher: Callable[[S, Fit], OpenedSearcher],
) -> Backend[S]:
    """A backend that keeps its own vectors: ``load`` puts the passages in it (embedded by what
    ``index build`` was given), ``open_searcher`` opens its searcher for serving, and the
    registry puts the index around it."""

    def build(chosen: S, request: BuildRequest) -> str:
        def embed(texts: Sequence[str]) -> np.ndarray:
            if request.embedder is None:
                return request.config.fit_and_embed(texts, progress=True)[1]
            return embed_in_batches(request.embedder, texts, show=True)

        return load(chosen, request.passages, embed, request.config.nlist, request.started)

    def open_index(chosen: S, directory: DataDirectory) -> OpenedIndex:
        opened = open_searcher(chosen, _fit_built_in)
        return _SearcherIndex(opened, around(opened))

    return Backend(name, stores, False, add_arguments, settings, build, open_index)


LOCAL: Backend[DirectorySettings] = Backend(
    "local", "local", False, _no_flags, _directory_settings, _build_directory, _open_directory
)
SHARDS: Backend[DirectorySettings] = Backend(
    "shards", "local", True, _no_flags, _shard_settings, _build_directory, _open_shard_manifests
)
PGVECTOR = searched(
    "pgvector", "pgvector", add_pgvector_arguments, pgvector.settings, pgvector.load, pgvector.open_served
)
BACKENDS: tuple[Backend[Any], ...] = (LOCAL, SHARDS, PGVECTOR)
"""Every backend, once; the first of those that store alike is the one chosen without shards."""


def stores() -> tuple[str, ...]:
    """``--backend``'s choices: where the vectors live, read from :data:`BACKENDS` when a parser
    is built (so a backend registered there, and only there, is offered)."""
    return tuple(dict.fromkeys(backend.stores for backend in BACKENDS))


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
    if not building and not sharded and vars(args).get("search_shard_cpus") is not None:
        raise InvalidInputError("--search-shard-cpus sizes the shard actors: give --search-shards too")
    alike = [backend for backend in BACKENDS if backend.stores == stores]
    backend = next((found for found in alike if found.sharded == sharded), alike[0])
    return Chosen(backend, backend.settings(args, building))


def data_directory(
    embedder: str | None = None, query_embedder: OpenAIEmbedder | None = None
) -> Chosen[DirectorySettings]:
    """The data directory's index embedded by ``embedder`` (None: the default), its questions by
    ``query_embedder`` when given: what a caller without a serving command line serves (a
    benchmark's, a test's)."""
    return Chosen(LOCAL, DirectorySettings(embedder or default_embedder(), query_embedder))


def add_arguments(parser: Flags, building: bool) -> None:
    """``--backend`` and every backend's flags (``building``: ``index build``'s, else ``serve``'s,
    with the embedder that embeds questions: index build has its own ``--embedder``)."""
    parser.add_argument(
        "--backend", choices=stores(), default=LOCAL.stores, help="where the vectors live (default: local)"
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
        "fitted on the passages as they fit it); openai: an OpenAI-compatible embedding server serving "
        "the index's model (--embedder-url, --embedder-model); sentence-transformers: with --backend "
        "pgvector",
    )
    add_brought_arguments(parser)
    parser.add_argument(
        "--embedder-timeout",
        type=float,
        default=DEFAULT_EMBEDDER_TIMEOUT_S,
        metavar="SECONDS",
        help="each call to the embedding server: past it the question answers 504 embedding_timeout "
        "(default: %(default)s)",
    )
