"""Cache-aware admission order for requests waiting for the engine (RAGCache §5.2).

When more requests wait than the engine's prefill pool takes, serving those with much cached
prefix and little to compute first raises the hit rate: their KV is reused before it can be
evicted, and short computations displace little. Ratio order alone can starve a request with
nothing cached, so a request that has waited longer than the starvation window goes next.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from specrag.errors import InvalidInputError

T = TypeVar("T")


@dataclass(order=True)
class _Entry(Generic[T]):
    neg_priority: float
    seq: int
    enqueued: float = field(compare=False)
    request: T = field(compare=False)
    taken: bool = field(default=False, compare=False)


class AdmissionQueue(Generic[T]):
    """Pop the highest cached/compute ratio, unless the oldest waited past ``starvation_window_s``.

    Ties go to the earlier request. ``clock`` is injectable so tests need not sleep.
    """

    def __init__(self, starvation_window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if starvation_window_s < 0:
            raise InvalidInputError("the starvation window cannot be negative")
        self.starvation_window_s = starvation_window_s
        self._clock = clock
        self._heap: list[_Entry[T]] = []
        self._fifo: deque[_Entry[T]] = deque()
        self._seq = itertools.count()
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def push(self, request: T, cached_tokens: int, compute_tokens: int) -> None:
        if cached_tokens < 0 or compute_tokens < 0:
            raise InvalidInputError("token counts cannot be negative")
        priority = cached_tokens / max(compute_tokens, 1)
        entry = _Entry(-priority, next(self._seq), self._clock(), request)
        heapq.heappush(self._heap, entry)
        self._fifo.append(entry)
        self._len += 1

    def pop(self) -> T:
        """The next request to admit; IndexError when empty."""
        if not self._len:
            raise IndexError("pop from an empty admission queue")
        while self._fifo[0].taken:
            self._fifo.popleft()
        oldest = self._fifo[0]
        if self._clock() - oldest.enqueued > self.starvation_window_s:
            entry = self._fifo.popleft()
            if len(self._heap) > 2 * self._len + 64:  # drop entries the FIFO already served
                self._heap = [e for e in self._heap if not e.taken and e is not entry]
                heapq.heapify(self._heap)
        else:
            while (entry := heapq.heappop(self._heap)).taken:
                pass
        entry.taken = True
        self._len -= 1
        return entry.request
