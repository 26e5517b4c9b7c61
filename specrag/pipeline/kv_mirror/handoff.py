"""The receiving thread's batches handed to the event loop, and applied there a little at a time.

The thread decodes and orders batches (:mod:`.reassembly`); the tree belongs to the loop, so
everything the mirror is told (apply, reset, degrade, unsure, joined, failed) is queued here in
order and run on the loop. A burst must not hold the loop while the service answers: each loop
turn runs queued work worth at most ``blocks_per_turn`` block events (whole batches: a batch is
applied all or nothing), then yields until the next turn. Nothing is dropped: the queue is
unbounded, and its length shows in the lag (:meth:`Handoff.lag`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial

from specrag.cache.events import AllBlocksCleared, KVEvent
from specrag.pipeline.kv_mirror.target import MirrorLag, MirrorTarget, apply_batch

__all__ = ["Handoff"]

logger = logging.getLogger(__name__)


_Item = tuple[float, int, Callable[[], None]]  # received (or queued) at, weight, what to run


class Handoff:
    """Runs ``final``'s calls, queued by the receiving thread, on ``loop`` (see the module).

    The thread side: :attr:`target` (what its :class:`EventSequence` feeds), :meth:`stamp`,
    :meth:`joined`, :meth:`position` (a :class:`.reassembly.Downstream`) and :meth:`failed`. The
    loop side: :attr:`joined_event`, :attr:`failure`, the counters and :meth:`lag`.
    """

    def __init__(self, final: MirrorTarget, *, blocks_per_turn: int) -> None:
        if blocks_per_turn < 1:
            raise ValueError(f"blocks_per_turn must be at least 1, got {blocks_per_turn}")
        self._final = final
        self._blocks_per_turn = blocks_per_turn
        self._loop: asyncio.AbstractEventLoop | None = None
        self._items: deque[_Item] = deque()
        self._lock = threading.Lock()
        self._scheduled = False
        self._closed = False
        # Thread side: the batch about to be handed on, and the last position queued.
        self._stamp = (-1, 0.0)
        self._queued_position = -1
        # Loop side.
        self.applied_position = -1  # the sequence position the loop has reached
        self.applied_batches = 0
        self.callback_errors = 0
        self.joined_event = asyncio.Event()
        self.failure: BaseException | None = None
        self.target = MirrorTarget(
            self._queue_apply,
            self._queue_reset,
            lambda reason: self._put(partial(final.degrade, reason)),
            lambda reason: self._put(partial(final.unsure, reason)),
        )

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """The loop that owns the tree (before the thread starts)."""
        self._loop = loop

    @property
    def loop_closed(self) -> bool:
        return self._loop is not None and self._loop.is_closed()

    # ------------------------------------------------------------------ the thread's side

    def stamp(self, seq: int, received_at: float) -> None:
        self._stamp = (seq, received_at)

    def joined(self) -> None:
        self._put(self.joined_event.set)

    def position(self, seq: int) -> None:
        if seq != self._queued_position:
            self._queued_position = seq
            self._put(partial(self._reached, None, seq))

    def failed(self, error: BaseException) -> None:
        self._put(partial(self._fail, error))

    def _queue_reset(self) -> None:
        self._queued_position = -1
        self._put(partial(self._reached, self._final.reset, -1))

    def _queue_apply(self, events: Sequence[KVEvent]) -> None:
        seq, received_at = self._stamp
        self._queued_position = seq
        weight = sum(
            0 if isinstance(event, AllBlocksCleared) else len(event.block_hashes) for event in events
        )
        self._put(partial(self._apply, seq, events), at=received_at, weight=max(1, weight))

    def _put(self, action: Callable[[], None], *, at: float | None = None, weight: int = 1) -> None:
        assert self._loop is not None, "bind the loop first"
        with self._lock:
            if self._closed:
                return
            self._items.append((time.monotonic() if at is None else at, weight, action))
            if self._scheduled:
                return
            self._scheduled = True
        self._loop.call_soon_threadsafe(self._drain)

    # ------------------------------------------------------------------ the loop's side

    def close(self) -> None:
        """Forget what is queued and take nothing more (the subscriber stopped)."""
        with self._lock:
            self._closed = True
            self._items.clear()

    def _drain(self) -> None:
        budget = self._blocks_per_turn
        items = self._items
        while items and budget > 0:
            _at, weight, action = items.popleft()
            try:
                action()
            except Exception:  # the queue must keep moving: the mirror says it may be wrong
                logger.exception("the KV mirror could not take what its subscriber handed it")
                with contextlib.suppress(Exception):
                    self._final.degrade("the KV mirror could not take an event it was handed")
            budget -= weight
        with self._lock:
            if not items:
                self._scheduled = False
                return
        assert self._loop is not None
        self._loop.call_soon(self._drain)  # the rest next turn, after what else is ready

    def _apply(self, seq: int, events: Sequence[KVEvent]) -> None:
        if apply_batch(self._final, seq, events):
            self.applied_batches += 1
        else:
            self.callback_errors += 1
        self.applied_position = seq

    def _reached(self, then: Callable[[], None] | None, seq: int) -> None:
        if then is not None:
            then()
        self.applied_position = seq

    def _fail(self, error: BaseException) -> None:
        self.failure = error
        self._final.unsure(f"the KV event subscriber stopped: {error!r}")

    def lag(self, known: int, oldest_held_at: float | None) -> MirrorLag:
        """How far behind the loop is, given the thread's highest known batch and the receipt time
        of the oldest batch it holds (read on the loop)."""
        try:
            oldest_queued: float | None = self._items[0][0]
        except IndexError:
            oldest_queued = None
        oldest = min((t for t in (oldest_held_at, oldest_queued) if t is not None), default=None)
        seconds = 0.0 if oldest is None else max(0.0, time.monotonic() - oldest)
        return MirrorLag(max(0, known - self.applied_position), seconds)
