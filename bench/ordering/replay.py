"""Arrival-timed replay of a document-ID trace through one prefill slot.

Requests arrive at their trace times and wait while the slot is busy, as final requests wait
for the service's prefill pool (``max_prefill_bs`` 1). Each one occupies the slot for the time
the prefill profile gives for its uncached tokens behind its cached ones, so reuse shortens the
queue. Who goes next when the slot frees:

- ``fifo``: arrival order; documents ordered by ``exact`` when the request is admitted;
- ``ratio``: RAGCache's queue (:class:`RatioQueue`): cached/compute ratio as predicted when
  the request arrived, with the starvation window;
- ``window``: :class:`WindowScheduler`: request and document order chosen together over the
  oldest waiting requests, against the tree at admission, with the same starvation window.
"""

from __future__ import annotations

import bisect
import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np

from bench.traces import TraceRequest
from specrag.cache import DocId, KnowledgeTree, PrefillProfile, RatioQueue, get_policy
from specrag.cache.prefill_queue import WindowScheduler
from specrag.errors import InvalidInputError

Admission = Literal["fifo", "ratio", "window"]
ADMISSIONS: tuple[Admission, ...] = ("fifo", "ratio", "window")


class ReplayServer(Protocol):
    """The simulated engine and its mirror, as the replay drives them."""

    tree: KnowledgeTree

    def prompt_tokens(self, request: TraceRequest) -> int: ...

    def serve(self, request: TraceRequest, docs: Sequence[DocId]) -> int:
        """Run the request with this document order; return its cached prompt tokens."""
        ...


@dataclass
class ReplayStats:
    """Queueing figures of one replay (seconds)."""

    waits: list[float] = field(default_factory=list)
    overtaken: list[int] = field(default_factory=list)
    busy_s: float = 0.0
    span_s: float = 0.0

    def summary(self) -> dict[str, float]:
        return {
            "wait_s_mean": float(np.mean(self.waits)) if self.waits else 0.0,
            "wait_s_p99": float(np.percentile(self.waits, 99)) if self.waits else 0.0,
            "wait_s_max": max(self.waits, default=0.0),
            "overtaken_max": max(self.overtaken, default=0),
            "utilisation": self.busy_s / self.span_s if self.span_s else 0.0,
        }


@dataclass(frozen=True, slots=True)
class Window:
    """How far the window scheduler may look: at most ``requests`` waiting requests, and with
    ``seconds`` only those that arrived within that long of the oldest waiting one."""

    requests: int = 16
    seconds: float | None = None

    @classmethod
    def parse(cls, text: str) -> Window:
        """``"16"`` (requests) or ``"250ms"`` (milliseconds; then up to 256 requests)."""
        try:
            if text.endswith("ms"):
                seconds = float(text[:-2]) / 1000
                if seconds < 0:
                    raise ValueError
                return cls(requests=256, seconds=seconds)
            requests = int(text)
            if requests < 1:
                raise ValueError
            return cls(requests=requests)
        except ValueError:
            raise InvalidInputError(
                f"--window must be a request count (16) or milliseconds (250ms), got {text!r}"
            ) from None


def saturating_rate(prompt_tokens: Sequence[int], profile: PrefillProfile, load: float) -> float:
    """Arrivals per second that keep one slot ``load`` times busy if nothing were cached."""
    mean_cold_s = float(np.mean([profile.seconds(tokens) for tokens in prompt_tokens]))
    return load / mean_cold_s


def arrival_times(trace: Sequence[TraceRequest], rate_per_s: float | None, seed: int = 0) -> list[float]:
    """A Poisson process at ``rate_per_s`` when given, else the trace's own arrival times."""
    if rate_per_s is None and all(r.arrival_s is not None for r in trace):
        times = [float(r.arrival_s) for r in trace if r.arrival_s is not None]
        if any(b < a for a, b in itertools.pairwise(times)):
            raise InvalidInputError("the trace's arrival_s values must not decrease")
        return times
    if rate_per_s is None or rate_per_s <= 0:
        raise InvalidInputError("the replay needs arrival_s on every line or a positive rate")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate_per_s, size=len(trace))
    return [float(t) for t in np.cumsum(gaps)]


class _Clock:
    """The replay's simulated time, read by the queues it drives."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def replay(
    trace: Sequence[TraceRequest],
    arrivals: Sequence[float],
    server: ReplayServer,
    admission: Admission,
    *,
    window: Window,
    starvation_window_s: float,
    profile: PrefillProfile,
) -> ReplayStats:
    """Serve the trace through one prefill slot; ``server`` records the execution order."""
    clock = _Clock()
    exact = get_policy("exact")
    queue: RatioQueue[int] = RatioQueue(starvation_window_s, clock=clock)
    scheduler: WindowScheduler[int] = WindowScheduler(
        starvation_window_s, window_requests=window.requests, window_s=window.seconds, clock=clock
    )
    fifo: deque[int] = deque()
    stats = ReplayStats()
    executed: list[int] = []  # arrival indices served so far, sorted
    free_at = 0.0
    arrived = 0
    while len(executed) < len(trace):
        if arrived == len(executed):  # nothing waits: the slot idles until the next arrival
            free_at = max(free_at, arrivals[arrived])
        while arrived < len(trace) and arrivals[arrived] <= free_at:
            clock.now = arrivals[arrived]  # queued at its arrival time
            request = trace[arrived]
            if admission == "window":
                scheduler.push(arrived, request.docs, server.prompt_tokens(request))
            elif admission == "ratio":
                cached = exact.order(server.tree, request.docs).cached.tokens
                queue.push(arrived, cached, server.prompt_tokens(request) - cached)
            else:
                fifo.append(arrived)
            arrived += 1
        clock.now = free_at
        if admission == "window":
            index, ordering = scheduler.pop(server.tree)
            docs = ordering.doc_ids
        else:
            index = queue.pop() if admission == "ratio" else fifo.popleft()
            docs = exact.order(server.tree, trace[index].docs).doc_ids
        stats.waits.append(free_at - arrivals[index])
        stats.overtaken.append(len(executed) - bisect.bisect_right(executed, index))
        bisect.insort(executed, index)
        request = trace[index]
        cached = server.serve(request, docs)
        service = profile.cost(cached, server.prompt_tokens(request) - cached)
        stats.busy_s += service
        free_at += service
    stats.span_s = free_at - (arrivals[0] if arrivals else 0.0)
    return stats
