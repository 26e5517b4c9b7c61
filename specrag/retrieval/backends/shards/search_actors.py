"""The shards of a sharded index as Ray actors, searched in stages from the controller's process.

Each shard is one actor (class :class:`~specrag.retrieval.backends.shards.shard_actor.SearchShard`, so ``ps``
shows ``ray::SearchShard`` and ``ray list actors`` ``specrag-search-shard-NNN``) that loads its own
directory, the lists memory-mapped where faiss allows (IVF), and runs the same staged search as an
in-process shard. On the controller's side a :class:`RemoteShard` stands for it behind the
:class:`~specrag.retrieval.backends.shards.merge.Shard` seam, so the merge, the stage plan, the
speculation policy and the timeline are those of an in-process sharded index: each stage sends
every shard "advance to ``n`` units" and gets its running top-k back, in one round trip.

Placement. Each actor asks Ray for ``num_cpus`` (a share of a core is allowed: a reservation for
Ray's placement, not a limit) and is waited for until placed for at most ``place_s``; past that
the error names the shard, what it asks for and what the cluster has free
(:mod:`~specrag.ray_placement`), instead of a start that never ends.

Faults. A call names the whole search so far (the query, the rows visible, the units to reach),
not a step of it: an actor that died and was restarted by Ray from its files (``max_restarts``,
and ``max_task_retries`` to replay the call in flight) recomputes the same running top-k from
scratch, since a staged search's result after ``n`` units does not depend on how they were cut.
A shard that does not answer within ``wait_s`` fails the search with
:class:`~specrag.errors.ShardUnavailableError` naming it (HTTP 503), and the abandoned call is
cancelled (``ray.cancel`` for a call Ray still holds, and each search carries its deadline, past
which the actor does not run it: an actor that comes back does not first work through searches
nobody waits for). A top-k missing a shard's rows is never served as if it
were whole, unless the request accepted one (``allow_partial``:
:class:`~specrag.retrieval.backends.shards.merge.ShardAnswers` names the shards that answered). Once Ray
gives up on an actor (its restarts spent), a new actor is started for the shard in the background
(calls meanwhile fail at once, naming it); each :class:`RemoteShard` keeps its
:class:`ShardState`, which ``/health`` shows, and a watcher asks every actor how it stands every
:data:`PROBE_EVERY_S`, so a death is noticed without a query.

Live documents. A row added to the index goes to the actor of the shard owning it, and its
:class:`RemoteShard` keeps it (:class:`~specrag.retrieval.backends.shards.added.AddedRows`): a restarted
actor reloads only its files. Every call carries the rows the shard should hold; an actor that
holds fewer answers :class:`~specrag.retrieval.backends.shards.shard_actor.Behind` instead, is sent the rows
it lacks, and is asked again, so a search that starts after an add's answer finds the row even on an
actor restarted since. Adds are idempotent: row numbers are the controller's, and the controller's
copy and the actor each keep a row once, however often its add is sent.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import ray
from ray.exceptions import ActorDiedError, GetTimeoutError, RayError

from specrag.errors import ArtifactError, InvalidInputError, ShardUnavailableError
from specrag.ray_placement import PLACEMENT_WAIT_S, unplaced
from specrag.retrieval.backends.shards.added import AddedRows
from specrag.retrieval.backends.shards.merge import ShardedSearcher, shard_name
from specrag.retrieval.backends.shards.shard_actor import (
    Behind,
    Expired,
    RowView,
    SearchShard,
    ShardInfo,
    ShardState,
)
from specrag.retrieval.backends.shards.store import shard_directory
from specrag.retrieval.embedders.embedder import METRIC
from specrag.retrieval.live_index import Visibility

__all__ = [
    "DEFAULT_WAIT_S",
    "PROBE_EVERY_S",
    "RemoteShard",
    "ShardState",
    "search_shards",
]

logger = logging.getLogger(__name__)

# How long a search waits for a shard (a restart included: loading a shard's files) before it
# fails naming the shard.
DEFAULT_WAIT_S = 30.0
# How long a shard may take to load at start, once placed.
_START_WAIT_S = 300.0
# How often the watcher asks each actor how it stands.
PROBE_EVERY_S = 5.0
# What changes a shard actor's CPU request, for errors that say Ray cannot place one.
_PLACEMENT_FIX = (
    "give --search-shard-cpus a smaller share, fewer --search-shards or --replicas, or a larger cluster"
)


class RemoteShard:
    """A :class:`~specrag.retrieval.backends.shards.merge.Shard` whose rows live in a ``SearchShard``
    actor; ``spawn(generation)`` starts a new actor for the shard and returns it once it has
    loaded the shard (with what it reports), used once Ray has given up on the old one."""

    def __init__(
        self,
        actor: Any,
        info: ShardInfo,
        name: str,
        wait_s: float,
        added: AddedRows | None = None,
        spawn: Callable[[int], tuple[Any, ShardInfo]] | None = None,
    ) -> None:
        self.actor = actor
        self.name = name
        self.kind = info.kind
        self._info = info
        self._wait_s = wait_s
        # Rows added since the shard's files were written, for an actor restarted from them.
        self.added = added or AddedRows(info.ntotal, info.next_row, info.dim)
        self._sending = threading.Lock()  # one add or catch-up at a time, in row order
        self._spawn = spawn
        self._swapping = threading.Lock()  # the actor and the state change together
        self._replacing: threading.Thread | None = None
        self.state = ShardState.SERVING
        self.reason: str | None = None
        self.restarts = 0  # restarts by Ray seen (a new process behind the same actor)
        self.replacements = 0  # new actors started after Ray gave up on one

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

    def health(self) -> dict[str, Any]:
        """What ``/health`` says of this shard."""
        return {
            "name": self.name,
            "state": self.state.value,
            "reason": self.reason,
            "pid": self._info.pid,
            "rows": self.added.ntotal,
            "restarts": self.restarts,
            "replacements": self.replacements,
        }

    def call(self, send: Callable[[Any], Any]) -> Any:
        """The result of ``send(actor)``, a call to the actor, or ShardUnavailableError naming the
        shard: at once while it is being replaced, after ``wait_s`` when it does not answer."""
        with self._swapping:
            actor, state, reason = self.actor, self.state, self.reason
        if state in (ShardState.REPLACING, ShardState.LOST):
            self._replace(actor, reason or "its actor died")
            raise ShardUnavailableError(f"search shard {self.name} is being replaced: {reason}")
        try:
            result = self._get(send(actor))
        except ActorDiedError as error:
            reason = f"its actor died and Ray gave up restarting it ({_cause(error)})"
            self._replace(actor, reason)
            raise ShardUnavailableError(
                f"search shard {self.name}: {reason}; a new actor is starting"
            ) from error
        except ShardUnavailableError as error:
            self._mark(actor, ShardState.UNRESPONSIVE, str(error))
            raise
        self._mark(actor, ShardState.SERVING, None)
        return result

    def _get(self, reference: Any) -> Any:
        """``reference``'s result within ``wait_s``; a call not answered in time is cancelled."""
        try:
            return ray.get(reference, timeout=self._wait_s)
        except GetTimeoutError as error:
            with contextlib.suppress(RayError, ValueError):
                ray.cancel(reference)  # abandoned: a queued call must not run when the actor is back
            raise ShardUnavailableError(
                f"search shard {self.name} did not answer within {self._wait_s:g}s"
            ) from error
        except ActorDiedError:
            raise
        except RayError as error:
            cause = getattr(error, "cause", None)
            if isinstance(cause, InvalidInputError):
                raise cause from error
            raise ShardUnavailableError(f"search shard {self.name} failed: {type(error).__name__}") from error

    def _mark(self, actor: Any, state: ShardState, reason: str | None) -> None:
        """What a call to ``actor`` found, unless the actor was replaced meanwhile."""
        with self._swapping:
            if self.actor is actor and self.state not in (ShardState.REPLACING, ShardState.LOST):
                self.state, self.reason = state, reason

    def _replace(self, dead: Any, reason: str) -> None:
        """Start a new actor for the shard in the background, once for each dead actor."""
        with self._swapping:
            if self.actor is not dead or (self._replacing is not None and self._replacing.is_alive()):
                return
            self.state, self.reason = ShardState.REPLACING, reason
            if self._spawn is None:
                self.state = ShardState.LOST
                return
            self._replacing = threading.Thread(
                target=self._start_replacement, args=(reason,), name=f"replace-shard-{self.name}", daemon=True
            )
            self._replacing.start()

    def _start_replacement(self, reason: str) -> None:
        assert self._spawn is not None
        try:
            actor, info = self._spawn(self.replacements + 1)
            if info.ntotal != self.added.base:
                raise ArtifactError(
                    f"its files hold {info.ntotal} rows, the index's manifest {self.added.base}"
                )
            with self._sending:
                held = info.ntotal
                while held < self.added.ntotal:
                    vectors, rows = self.added.since(held)
                    held = int(self._get(actor.add_rows.remote(vectors, rows, self.added.next_row, held)))
        except Exception as error:  # any failure leaves the shard failed, said in /health
            with self._swapping:
                self.state, self.reason = ShardState.LOST, f"{reason}; its new actor did not start: {error}"
            return
        with self._swapping:
            self.actor, self._info = actor, info
            self.replacements += 1
            self.state, self.reason = ShardState.SERVING, None

    def probe(self) -> None:
        """Ask the actor how it stands (bounded): a dead actor is replaced, a restarted one is
        sent the rows it lacks; the state is updated either way."""
        with contextlib.suppress(ShardUnavailableError):
            info: ShardInfo = self.call(lambda actor: actor.info.remote())
            with self._swapping:
                if info.pid != self._info.pid:
                    self.restarts += 1
                    self._info = info
            if info.ntotal < self.added.ntotal:
                self.catch_up(info.ntotal)

    def answer(self, send: Callable[[Any, int, float], Any]) -> Any:
        """The actor's answer to ``send(actor, rows it should hold, deadline)``, once it holds
        them: an actor restarted from its files since rows were added is sent those first. Past
        the deadline (``wait_s`` on) the actor does not run the call."""
        while True:
            result = self.call(functools.partial(_sent, send, self.added.ntotal, time.time() + self._wait_s))
            if isinstance(result, Expired):  # the actor's clock runs ahead of ours
                raise ShardUnavailableError(f"search shard {self.name} answered after its deadline")
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
        next_row = self.added.next_row
        return int(self.call(lambda actor: actor.add_rows.remote(vectors, rows, next_row, held)))

    def cursor(self, queries: np.ndarray, k: int, visibility: Visibility | None = None) -> _RemoteCursor:
        return _RemoteCursor(self, np.ascontiguousarray(queries), k, RowView.of(visibility))

    def search(
        self, queries: np.ndarray, k: int, visibility: Visibility | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        matrix, view = np.ascontiguousarray(queries), RowView.of(visibility)
        result: tuple[np.ndarray, np.ndarray] = self.answer(
            lambda actor, held, deadline: actor.search.remote(matrix, k, view, held, deadline)
        )
        return result

    def add_rows(self, vectors: np.ndarray, rows: np.ndarray, next_row: int) -> None:
        """Add ``rows`` to the actor, kept here too for the actor's restarts; returns once the
        actor holds them (a search that starts after this finds them). Sent again after a lost
        answer, the rows are kept and added once: both sides skip the rows they hold."""
        numbers = np.asarray(rows, dtype=np.int64)
        with self._sending:
            self.added.record(vectors, numbers, next_row)
            held = self.added.held_before(int(numbers[0])) if len(numbers) else self.added.ntotal
            now = self._send(*self.added.since(held), held)
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
        target, queries, k, view = self._units, self._queries, self._k, self._view
        done, distances, ids = self._shard.answer(
            lambda actor, held, deadline: actor.advance_to.remote(
                self._id, target, queries, k, view, held, deadline
            )
        )
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
    place_s: float = PLACEMENT_WAIT_S,
    probe_every_s: float = PROBE_EVERY_S,
) -> Iterator[ShardedSearcher]:
    """One ``SearchShard`` actor per shard of the index version in ``directory`` (its manifest's
    searcher ``settings``) on the running Ray cluster (``ray.init`` first), each asking for
    ``num_cpus`` and placed within ``place_s``, merged; the actors are stopped on exit.
    ``directory`` must be where every node finds the shards (shared storage on a cluster); ``mmap``
    maps IVF lists from the files (an actor reads them into memory when it is first given a
    document). ``added`` (one a shard): the rows added since the files were written (the live
    log replayed), sent to each actor before it serves.
    """
    count = int(settings["shards"])
    quantizer = settings.get("quantizer_sha256")
    mapped = mmap and settings.get("kind") == "ivf"  # faiss maps inverted lists, not graphs
    actor_class: Any = ray.remote(SearchShard)
    placement = {"num_cpus": num_cpus}
    actors: list[Any] = []
    stop = threading.Event()

    def spawn(number: int, generation: int = 0) -> Any:
        """An actor for shard ``number`` (a dead actor's name stays taken for a while: a
        replacement is named after its generation)."""
        if stop.is_set():
            raise ShardUnavailableError(f"search shard {shard_name(number)}: the service is stopping")
        suffix = f"-{generation}" if generation else ""
        actor = actor_class.options(
            name=f"specrag-search-shard-{shard_name(number)}{suffix}",
            max_restarts=max_restarts,
            max_task_retries=-1,
            **placement,
        ).remote(str(shard_directory(directory, number)), number, count, quantizer, mapped)
        actors.append(actor)
        return actor

    def respawn(number: int, generation: int) -> tuple[Any, ShardInfo]:
        """A replacement for shard ``number``'s actor, once it has loaded the shard."""
        actor = spawn(number, generation)
        try:
            return actor, _loaded(actor, shard_name(number), placement, place_s, wait_s)
        except BaseException:
            with contextlib.suppress(RayError):
                ray.kill(actor, no_restart=True)
            raise

    for number in range(count):
        spawn(number)
    executor = ThreadPoolExecutor(count, thread_name_prefix="search-shard")
    watcher: threading.Thread | None = None
    try:
        shards = [
            _started(
                actor,
                shard_name(number),
                wait_s,
                added[number] if added else None,
                placement,
                place_s,
                functools.partial(respawn, number),
            )
            for number, actor in enumerate(list(actors))
        ]
        watcher = threading.Thread(target=_watch, args=(shards, stop, probe_every_s), daemon=True)
        watcher.start()
        keep_max = METRIC == "inner_product"  # the embedders' unit vectors, searched by inner product
        next_row = max(shard.next_row for shard in shards)
        yield ShardedSearcher(shards, quantizer, keep_max, next_row=next_row, fan_out=executor)
    finally:
        stop.set()
        if watcher is not None:
            watcher.join(timeout=wait_s + probe_every_s)
        executor.shutdown(wait=False, cancel_futures=True)
        for actor in actors:
            with contextlib.suppress(RayError):
                ray.kill(actor, no_restart=True)


def _watch(shards: Sequence[RemoteShard], stop: threading.Event, every_s: float) -> None:
    """Probe every shard each ``every_s`` until ``stop``."""
    while not stop.wait(every_s):
        for shard in shards:
            if stop.is_set():
                return
            try:
                shard.probe()
            except Exception:  # the watcher must outlive one bad probe: the next one may pass
                logger.exception("probing search shard %s failed", shard.name)


def _loaded(actor: Any, name: str, placement: dict[str, float], place_s: float, wait_s: float) -> ShardInfo:
    """What ``actor`` reports once placed (within ``place_s``) and its shard loaded."""
    try:
        ray.get(actor.__ray_ready__.remote(), timeout=place_s)
    except GetTimeoutError:
        raise ShardUnavailableError(
            unplaced(f"search shard {name}", placement, place_s, _PLACEMENT_FIX)
        ) from None
    try:
        info: ShardInfo = ray.get(actor.info.remote(), timeout=max(wait_s, _START_WAIT_S))
    except (RayError, GetTimeoutError) as error:
        cause = getattr(error, "cause", None) or error
        raise ShardUnavailableError(f"search shard {name} did not start: {cause}") from error
    return info


def _started(
    actor: Any,
    name: str,
    wait_s: float,
    added: AddedRows | None,
    placement: dict[str, float],
    place_s: float,
    spawn: Callable[[int], tuple[Any, ShardInfo]],
) -> RemoteShard:
    """The shard once its actor has been placed and has loaded it (loading takes longer than a
    search waits) and holds the rows ``added`` since its files were written."""
    info = _loaded(actor, name, placement, place_s, wait_s)
    if added is not None and added.base != info.ntotal:
        raise InvalidInputError(
            f"search shard {name}: its files hold {info.ntotal} rows, the index's manifest {added.base}"
            " (written by another build?): rebuild the index (`specrag index build --shards N`)"
        )
    shard = RemoteShard(actor, info, name, wait_s, added, spawn)
    shard.catch_up(info.ntotal)
    return shard


def _sent(send: Callable[[Any, int, float], Any], held: int, deadline: float, actor: Any) -> Any:
    """``send(actor, held, deadline)``: a call given the actor it goes to last."""
    return send(actor, held, deadline)


def _cause(error: RayError) -> str:
    """The first line of Ray's account of an error."""
    text = str(error)
    return text.splitlines()[0] if text else type(error).__name__
