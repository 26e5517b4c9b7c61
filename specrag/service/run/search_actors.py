"""The shards of a sharded index as Ray actors, searched in stages from the controller's process.

Each shard is one actor (class :class:`SearchShard`, so ``ps`` shows ``ray::SearchShard`` and
``ray list actors`` ``specrag-search-shard-NNN``) that loads its own directory, the lists
memory-mapped where faiss allows (IVF), and runs the same staged search as an in-process shard.
On the controller's side a :class:`RemoteShard` stands for it behind the
:class:`~specrag.retrieval.shards.merge.Shard` seam, so the merge, the stage plan, the
speculation policy and the timeline are those of an in-process sharded index: each stage sends
every shard "advance to ``n`` units" and gets its running top-k back, in one round trip.

Faults. A call names the whole search so far (the query, the rows visible, the units to reach),
not a step of it: an actor that died and was restarted by Ray from its files (``max_restarts``,
and ``max_task_retries`` to replay the call in flight) recomputes the same running top-k from
scratch, since a staged search's result after ``n`` units does not depend on how they were cut.
A shard that does not answer within ``wait_s`` fails the search with
:class:`~specrag.errors.ShardUnavailableError` naming it (HTTP 503): a top-k missing a shard's
rows is never served as if it were whole, unless the request accepted one (``allow_partial``:
:class:`~specrag.retrieval.shards.merge.ShardAnswers` names the shards that answered).

Live documents. A row added to the index goes to the actor of the shard owning it, and its
:class:`RemoteShard` keeps it (:class:`~specrag.retrieval.shards.added.AddedRows`): a restarted
actor reloads only its files. Every call carries the rows the shard should hold; an actor that
holds fewer answers :class:`Behind` instead, is sent the rows it lacks, and is asked again, so a
search that starts after an add's answer finds the row even on an actor restarted since.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import ray
from ray.exceptions import GetTimeoutError, RayError

from specrag.errors import InvalidInputError, ShardUnavailableError
from specrag.retrieval.embedders import METRIC
from specrag.retrieval.live_index import Visibility
from specrag.retrieval.shards.added import AddedRows
from specrag.retrieval.shards.merge import ShardedSearcher, shard_name
from specrag.retrieval.shards.store import load_shard, shard_directory

__all__ = [
    "DEFAULT_WAIT_S",
    "Behind",
    "RemoteShard",
    "RowView",
    "SearchShard",
    "ShardInfo",
    "search_shards",
]

# How long a search waits for a shard (a restart included: loading a shard's files) before it
# fails naming the shard.
DEFAULT_WAIT_S = 30.0
# Searches a shard actor keeps in progress; the oldest is dropped past this (a search cancelled
# by its caller never says so), and is recomputed if it ever asks again.
_CURSORS_KEPT = 256
# How long a shard may take to load at start.
_START_WAIT_S = 300.0


@dataclass(frozen=True)
class ShardInfo:
    """What a started shard actor reports about itself."""

    kind: str
    dim: int
    ntotal: int
    expected_units: int
    settings: dict[str, Any]
    next_row: int
    pid: int


@dataclass(frozen=True)
class Behind:
    """An actor's answer when it holds fewer rows than the call says it should (restarted from
    its files since rows were added): ``held``, the rows it holds."""

    held: int


@dataclass(frozen=True)
class RowView:
    """The rows a search may return, sent to a shard: the rows the snapshot knows and the hidden
    ones among them (few: replaced or deleted documents), not a flag for every row."""

    rows_known: int
    hidden: np.ndarray

    @classmethod
    def of(cls, visibility: Visibility | None) -> RowView | None:
        """``visibility`` as a view to send (None: every row is visible)."""
        if visibility is None or not visibility.hidden:
            return None
        return cls(len(visibility.visible), np.flatnonzero(~visibility.visible))

    @property
    def key(self) -> str:
        return f"{self.rows_known}:{hashlib.sha256(self.hidden.tobytes()).hexdigest()}"

    def visibility(self) -> Visibility:
        mapping = np.concatenate([np.arange(self.rows_known, dtype=np.int64), [-1]])
        mapping[self.hidden] = -1
        return Visibility(mapping, len(self.hidden))


class SearchShard:
    """The actor's body: one shard, loaded from its directory, and the searches in progress."""

    def __init__(
        self, directory: str, number: int, count: int, quantizer_sha256: str | None, mmap: bool
    ) -> None:
        # One faiss thread: a single query's slice gains nothing from more, and their OpenMP
        # threads spin while they wait for each other on a node that is busy.
        faiss.omp_set_num_threads(1)
        self._load = functools.partial(load_shard, Path(directory), number, count, quantizer_sha256)
        self._mapped = mmap
        self._shard = self._load(mmap=mmap)
        self._cursors: OrderedDict[str, tuple[Any, int, bool]] = OrderedDict()
        self._view: tuple[str, Visibility] | None = None

    def info(self) -> ShardInfo:
        shard = self._shard
        return ShardInfo(
            shard.kind,
            shard.dim,
            shard.ntotal,
            shard.expected_units,
            shard.settings,
            shard.next_row,
            os.getpid(),
        )

    def _visibility(self, view: RowView | None) -> Visibility | None:
        if view is None:
            return None
        if self._view is None or self._view[0] != view.key:
            self._view = (view.key, view.visibility())
        return self._view[1]

    def add_rows(self, vectors: np.ndarray, rows: np.ndarray, next_row: int, held: int) -> int:
        """Add ``rows`` (their ``vectors``), which follow the shard's first ``held`` rows; the
        rows it holds then. Rows it holds already (a call replayed) are skipped; holding fewer
        than ``held`` (restarted since), it adds nothing and the caller sends what it lacks."""
        have = self._shard.ntotal
        if have < held:
            return int(have)
        skip = have - held
        if skip < len(rows):
            if self._mapped:  # mapped lists are read-only: read them into memory once
                self._shard = self._load(mmap=False)
                self._mapped = False
            self._shard.add_rows(vectors[skip:], rows[skip:], next_row)
        return int(self._shard.ntotal)

    def advance_to(
        self, search_id: str, target: int, queries: np.ndarray, k: int, view: RowView | None, held: int
    ) -> tuple[bool, np.ndarray, np.ndarray] | Behind:
        """Advance search ``search_id`` until it has done ``target`` units (starting it, from
        the query and the view, when this actor does not hold it); its running top-k, or
        :class:`Behind` while the shard holds fewer than ``held`` rows."""
        if self._shard.ntotal < held:
            return Behind(int(self._shard.ntotal))
        entry = self._cursors.pop(search_id, None)
        if entry is None:
            entry = (self._shard.cursor(queries, k, self._visibility(view)), 0, False)
        cursor, units, done = entry
        if units < target and not done:
            done = cursor.advance(target - units)
            units = target
        distances, ids = cursor.snapshot()
        if not done:
            self._cursors[search_id] = (cursor, units, done)
            while len(self._cursors) > _CURSORS_KEPT:
                self._cursors.popitem(last=False)
        return done, distances, ids

    def search(
        self, queries: np.ndarray, k: int, view: RowView | None, held: int
    ) -> tuple[np.ndarray, np.ndarray] | Behind:
        if self._shard.ntotal < held:
            return Behind(int(self._shard.ntotal))
        result: tuple[np.ndarray, np.ndarray] = self._shard.search(queries, k, self._visibility(view))
        return result


class RemoteShard:
    """A :class:`~specrag.retrieval.shards.merge.Shard` whose rows live in a :class:`SearchShard` actor."""

    def __init__(
        self, actor: Any, info: ShardInfo, name: str, wait_s: float, added: AddedRows | None = None
    ) -> None:
        self.actor = actor
        self.name = name
        self.kind = info.kind
        self._info = info
        self._wait_s = wait_s
        # Rows added since the shard's files were written, for an actor restarted from them.
        self.added = added or AddedRows(info.ntotal, info.next_row, info.dim)
        self._sending = threading.Lock()  # one add or catch-up at a time, in row order

    @property
    def dim(self) -> int:
        return self._info.dim

    @property
    def ntotal(self) -> int:
        return self.added.ntotal

    @property
    def settings(self) -> dict[str, Any]:
        return self._info.settings

    @property
    def expected_units(self) -> int:
        return self._info.expected_units

    @property
    def next_row(self) -> int:
        return self.added.next_row

    @property
    def info(self) -> ShardInfo:
        """What the actor reported when it started (its process id among it)."""
        return self._info

    def call(self, reference: Any) -> Any:
        """The result of a call to the actor, or ShardUnavailableError naming the shard."""
        try:
            return ray.get(reference, timeout=self._wait_s)
        except GetTimeoutError as error:
            raise ShardUnavailableError(
                f"search shard {self.name} did not answer within {self._wait_s:g}s"
            ) from error
        except RayError as error:
            cause = getattr(error, "cause", None)
            if isinstance(cause, InvalidInputError):
                raise cause from error
            raise ShardUnavailableError(f"search shard {self.name} failed: {type(error).__name__}") from error

    def answer(self, send: Callable[[int], Any]) -> Any:
        """The actor's answer to ``send(rows it should hold)``, once it holds them: an actor
        restarted from its files since rows were added is sent those first."""
        while True:
            result = self.call(send(self.added.ntotal))
            if not isinstance(result, Behind):
                return result
            self.catch_up(result.held)

    def catch_up(self, held: int) -> None:
        """Send the actor, which holds ``held`` rows, every added row it lacks."""
        with self._sending:
            while held < self.added.ntotal:
                vectors, rows = self.added.since(held)
                held = self._send(vectors, rows, held)

    def _send(self, vectors: np.ndarray, rows: np.ndarray, held: int) -> int:
        """Add ``rows`` after the actor's first ``held``; the rows it holds then."""
        reference = self.actor.add_rows.remote(vectors, rows, self.added.next_row, held)
        return int(self.call(reference))

    def cursor(self, queries: np.ndarray, k: int, visibility: Visibility | None = None) -> _RemoteCursor:
        return _RemoteCursor(self, np.ascontiguousarray(queries), k, RowView.of(visibility))

    def search(
        self, queries: np.ndarray, k: int, visibility: Visibility | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        matrix, view = np.ascontiguousarray(queries), RowView.of(visibility)
        result: tuple[np.ndarray, np.ndarray] = self.answer(
            functools.partial(self.actor.search.remote, matrix, k, view)
        )
        return result

    def add_rows(self, vectors: np.ndarray, rows: np.ndarray, next_row: int) -> None:
        """Add ``rows`` to the actor, kept here too for the actor's restarts; returns once the
        actor holds them (a search that starts after this finds them)."""
        with self._sending:
            held = self.added.ntotal
            self.added.record(vectors, rows, next_row)
            now = self._send(np.ascontiguousarray(vectors, dtype=np.float32), np.asarray(rows), held)
        if now < self.added.ntotal:  # restarted before this add: it lacks earlier ones too
            self.catch_up(now)

    def compacted(self, keep: np.ndarray) -> Any:
        raise InvalidInputError("a sharded index on Ray is compacted by rebuilding it (specrag index build)")

    def stored_vectors(self, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        raise InvalidInputError("a sharded index on Ray does not send its vectors back")

    def kill(self) -> None:
        """Kill the actor as a crash would (Ray restarts it): for fault tests and benchmarks."""
        ray.kill(self.actor, no_restart=False)


class _RemoteCursor:
    """One search on one shard actor: each advance asks for the units done so far in all."""

    def __init__(self, shard: RemoteShard, queries: np.ndarray, k: int, view: RowView | None) -> None:
        self._shard = shard
        self._queries = queries
        self._k = k
        self._view = view
        self._id = uuid.uuid4().hex
        self._units = 0
        self._top: tuple[np.ndarray, np.ndarray] | None = None

    def advance(self, units: int) -> bool:
        self._units += units
        send = functools.partial(
            self._shard.actor.advance_to.remote, self._id, self._units, self._queries, self._k, self._view
        )
        done, distances, ids = self._shard.answer(send)
        self._top = (distances, ids)
        return bool(done)

    def snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        assert self._top is not None, "a cursor is advanced before it is read"
        return self._top


@contextlib.contextmanager
def search_shards(
    directory: Path,
    settings: dict[str, Any],
    *,
    wait_s: float = DEFAULT_WAIT_S,
    mmap: bool = True,
    num_cpus: float = 1,
    max_restarts: int = 3,
    added: Sequence[AddedRows] | None = None,
) -> Iterator[ShardedSearcher]:
    """One :class:`SearchShard` actor per shard of the index version in ``directory`` (its
    manifest's searcher ``settings``) on the running Ray cluster (``ray.init`` first), merged;
    the actors are stopped on exit. ``directory`` must be where every node finds the shards
    (shared storage on a cluster); ``mmap`` maps IVF lists from the files (an actor reads them
    into memory when it is first given a document). ``added`` (one a shard): the rows added
    since the files were written (the live log replayed), sent to each actor before it serves.
    """
    count = int(settings["shards"])
    quantizer = settings.get("quantizer_sha256")
    mapped = mmap and settings.get("kind") == "ivf"  # faiss maps inverted lists, not graphs
    actor_class: Any = ray.remote(SearchShard)
    actors = [
        actor_class.options(
            name=f"specrag-search-shard-{shard_name(number)}",
            max_restarts=max_restarts,
            max_task_retries=-1,
            num_cpus=num_cpus,
        ).remote(str(shard_directory(directory, number)), number, count, quantizer, mapped)
        for number in range(count)
    ]
    executor = ThreadPoolExecutor(count, thread_name_prefix="search-shard")
    try:
        shards = [
            _started(actor, shard_name(number), wait_s, added[number] if added else None)
            for number, actor in enumerate(actors)
        ]
        keep_max = METRIC == "inner_product"  # the embedders' unit vectors, searched by inner product
        next_row = max(shard.next_row for shard in shards)
        yield ShardedSearcher(shards, quantizer, keep_max, next_row=next_row, fan_out=executor)
    finally:
        executor.shutdown(wait=False, cancel_futures=True)
        for actor in actors:
            with contextlib.suppress(RayError):
                ray.kill(actor, no_restart=True)


def _started(actor: Any, name: str, wait_s: float, added: AddedRows | None) -> RemoteShard:
    """The shard once its actor has loaded it (loading takes longer than a search waits) and
    holds the rows ``added`` since its files were written."""
    try:
        info = ray.get(actor.info.remote(), timeout=max(wait_s, _START_WAIT_S))
    except (RayError, GetTimeoutError) as error:
        cause = getattr(error, "cause", None) or error
        raise ShardUnavailableError(f"search shard {name} did not start: {cause}") from error
    if added is not None and added.base != info.ntotal:
        raise InvalidInputError(
            f"search shard {name}: its files hold {info.ntotal} rows, the index's manifest {added.base}"
            " (written by another build?): rebuild the index (`specrag index build --shards N`)"
        )
    shard = RemoteShard(actor, info, name, wait_s, added)
    shard.catch_up(info.ntotal)
    return shard
