"""Run a simulation in virtual time: the clock moves only when every task waits.

Why: a simulation of many simulated engines (``bench.scale``) in scaled wall-clock time measures
the machine as much as the system: the router's and the simulator's own CPU time, and whatever
else runs on the machine, delay steps and arrivals, lengthen queues and so change both the
TTFTs and where prompts go. In virtual time, computation takes no time at all and a sleep ends
exactly when it should, so the same seed gives the same result on a quiet machine and a busy
one. (What the router's computation costs is then measured separately, in real time.)

How: an asyncio event loop whose :meth:`VirtualTimeLoop.time` is a counter. When the loop would
block in its selector waiting for the next timer, it polls the selector without blocking instead
and, if nothing is ready, advances the counter to that timer. Real I/O and thread wake-ups still
work (they are polled), but the clock does not wait for them: work in a thread takes whatever
virtual time the loop's timers skip meanwhile, so simulate only code whose timing lives on the
loop (the simulated engine, the routers, the replay). :func:`specrag.pipeline.engines.protocol.now` reads
the same counter while :func:`run` runs (:func:`clock`), so timelines, queues and first-token times agree with
the engines' sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import selectors
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

from specrag.pipeline.engines import protocol

__all__ = ["VirtualTimeLoop", "clock", "run"]

T = TypeVar("T")


class _AdvancingSelector(selectors.DefaultSelector):
    """Never sleeps for a timer: polls, and when nothing is ready moves the clock to the timer."""

    def __init__(self, advance: Callable[[float], None]) -> None:
        super().__init__()
        self._advance = advance

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        if timeout is None:  # no timer at all: only real I/O can wake the loop
            return super().select(None)
        ready = super().select(0)
        if not ready and timeout > 0:
            self._advance(timeout)
        return ready


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop on a virtual clock that starts at 0 (module doc)."""

    def __init__(self) -> None:
        self._virtual_now = 0.0
        super().__init__(_AdvancingSelector(self._advance))

    def time(self) -> float:
        return self._virtual_now

    def _advance(self, seconds: float) -> None:
        self._virtual_now += seconds


@contextlib.contextmanager
def clock(source: Callable[[], float]) -> Iterator[None]:
    """Make :func:`specrag.pipeline.engines.protocol.now` read ``source`` while the block runs.

    Why: a simulation in virtual time must stamp first tokens, queues and timelines on the same
    clock its engines sleep on, or machine load would leak into its results through the gap
    between the two clocks. The swap lives here, not in the protocol module, so that the product's
    ``now()`` stays one plain call that nothing on the real path ever changes.
    """
    previous, protocol._clock = protocol._clock, source
    try:
        yield
    finally:
        protocol._clock = previous


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run ``main`` to completion in virtual time, with
    :func:`~specrag.pipeline.engines.protocol.now` on it."""
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        loop = runner.get_loop()
        with clock(loop.time):
            return runner.run(main)
