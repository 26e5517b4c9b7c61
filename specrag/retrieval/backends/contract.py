"""What every retrieval backend gives, so that the command line and the service look a backend
up (:mod:`specrag.retrieval.backends.registry`) instead of testing which one it is.

A backend is registered once, as a :class:`Backend`: its flags, its typed settings read from
them (a combination it cannot serve is refused there, before any file, table or engine is
touched), its build (``specrag index build``) and its ``open`` for serving, which gives an
:class:`OpenedIndex`: the passages, the index, where the documents' record is kept, the close
and the backend's part of ``/health``. The opened index is given in two steps, the passages
first, so that the service can verify the model (which the random model's tokenizer trains on
the passages) and start the engine while the index loads.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import numpy as np

from specrag.retrieval.corpus import Passage
from specrag.retrieval.embedders.embedder import Embedder
from specrag.retrieval.index_store import IndexConfig
from specrag.retrieval.lexical.bm25 import LexicalIndex
from specrag.retrieval.search.stages import StagedSearcher
from specrag.retrieval.vector_index import VectorIndex

if TYPE_CHECKING:  # aiohttp's client is imported only for a server
    from specrag.retrieval.embedders.http_embedder import OpenAIEmbedder

__all__ = [
    "Backend",
    "BuildRequest",
    "DataDirectory",
    "Embed",
    "Fit",
    "Flags",
    "OpenedIndex",
    "OpenedSearcher",
]

Flags = argparse._ActionsContainer
"""Where a backend adds its flags: a parser or one of its argument groups."""


@dataclass(frozen=True)
class BuildRequest:
    """What ``specrag index build`` asks of a backend: the passages, how to embed and index them
    (``embedder``: a brought one, else ``config``'s built-in one), the index directory, and when
    the build started (``time.perf_counter``'s, for the line that says how long it took)."""

    passages: Sequence[Passage]
    config: IndexConfig
    embedder: Embedder | None
    output: Path
    started: float


class DataDirectory(Protocol):
    """The data directory's corpus and index as the service prepares them (checked against the
    document store and rebuilt when stale, which only the service can do): what a backend whose
    index lives there opens."""

    def passages(self) -> list[Passage]:
        """The corpus, built or copied into the data directory when needed."""
        ...

    def index(
        self,
        passages: list[Passage],
        config: IndexConfig,
        shard_vectors: bool,
        query_embedder: OpenAIEmbedder | None = None,
    ) -> VectorIndex:
        """The index over ``passages``; without ``shard_vectors`` a sharded one as its shards'
        manifests (their actors hold the vectors); ``query_embedder``: an embedding server that
        must serve the index's model, and embeds its questions and documents."""
        ...


class OpenedIndex(Protocol):
    """A backend's index opened for serving, passages first (row i = passage i)."""

    @property
    def passages(self) -> list[Passage]: ...

    @property
    def store_name(self) -> str | None:
        """The directory under ``DATA_DIR/external`` holding the passages' document store (a
        cache of rows that live elsewhere); None: the data directory's own store."""
        ...

    @property
    def table(self) -> StagedSearcher | None:
        """The searcher whose table is the documents' record (the documents API writes through
        to it); None: the data directory's log of changes is."""
        ...

    @property
    def documents_off(self) -> str | None:
        """What the documents API says when it cannot change the table (None: not a table)."""
        ...

    def index(self) -> VectorIndex:
        """The index, loaded (or built) now: called once the model is verified."""
        ...

    def close(self) -> None:
        """Let go of what the index holds outside this process (a database's connections)."""
        ...

    def health(self, bound_s: float) -> dict[str, Any] | None:
        """The backend's part of ``/health``, within ``bound_s`` (it may ask a server); None:
        nothing to say. A part with ``"serving": False`` fails every query: ``/health`` is 503."""
        ...


class OpenedSearcher(Protocol):
    """What a backend that keeps its own vectors (a database's table) opens for serving: its
    searcher, its rows as passages (row i = passage i), the query embedder and the lexical
    channel (None: the searcher's own, or none); the registry puts the index around them."""

    @property
    def searcher(self) -> StagedSearcher: ...

    @property
    def passages(self) -> list[Passage]: ...

    @property
    def embedder(self) -> Embedder: ...

    @property
    def lexical(self) -> LexicalIndex | None: ...

    @property
    def store_name(self) -> str | None: ...

    @property
    def table(self) -> StagedSearcher | None: ...

    @property
    def documents_off(self) -> str | None: ...

    def close(self) -> None: ...

    def health(self, bound_s: float) -> dict[str, Any] | None: ...


Fit = Callable[[str, Sequence[str]], Embedder]
"""The built-in embedder of a name, fitted on the texts as ``index build`` fits it."""
Embed = Callable[[Sequence[str]], np.ndarray]
"""The vectors of the texts, by the embedder ``index build`` was given (row i = text i)."""

S = TypeVar("S")


@dataclass(frozen=True)
class Backend(Generic[S]):
    """One retrieval backend, registered once in :mod:`specrag.retrieval.backends.registry`.

    ``stores``: the ``--backend`` value that names where its vectors live (two backends may
    share it: a sharded index lives in the data directory too); ``sharded``: whether it is the
    one of them chosen when shards are asked for (``--search-shards``, ``--shards N``).
    """

    name: str
    stores: str
    sharded: bool
    add_arguments: Callable[[Flags, bool], None]
    """Its own flags (``True``: ``index build``'s, else ``serve``'s)."""
    settings: Callable[[argparse.Namespace, bool], S]
    """Its typed settings from ``index build``'s flags (``True``) or ``serve``'s; InvalidInputError
    for what it refuses, touching nothing."""
    build: Callable[[S, BuildRequest], str]
    """Index ``BuildRequest.passages``; returns the line that says what was built."""
    open: Callable[[S, DataDirectory], OpenedIndex]
