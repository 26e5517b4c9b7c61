"""Polling until something holds: a condition, an engine's queues, a controller's requests."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable

from specrag.controller.controller import RagController
from specrag.pipeline.engines.protocol import (
    Engine,
    EngineCounts,
)


async def wait_until(
    condition: Callable[[], bool | Awaitable[bool]],
    within_s: float = 5.0,
    *,
    every_s: float = 0.05,
    what: Callable[[], str] | None = None,
) -> None:
    """Poll ``condition`` (sync or async) until it holds; AssertionError if not within ``within_s``.

    ``every_s`` is how long to yield between polls (short for the simulated engine, whose steps
    take milliseconds); ``what`` describes the state when it fails.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while True:
        result = condition()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if loop.time() > deadline:
            raise AssertionError(f"not within {within_s} s" + (f": {what()}" if what else ""))
        await asyncio.sleep(every_s)


def engine_queues_empty(counts: EngineCounts) -> bool:
    return counts.running == counts.waiting == counts.unfinished == 0


async def engine_idle(engine: Engine) -> bool:
    """The engine's own queues (not our bookkeeping) hold nothing."""
    return engine_queues_empty(await engine.counts())


async def assert_engine_idle(engine: Engine, controller: RagController, within_s: float = 5.0) -> None:
    """No request of ours remains: neither in the controller, nor in the engine's own queues."""
    last: list[EngineCounts] = []

    async def idle() -> bool:
        last[:] = [await engine.counts()]
        return (
            engine_queues_empty(last[0])
            and not controller.in_flight_request_ids()
            and controller.gate.pool == 0
        )

    def left() -> str:
        return f"requests left: {controller.in_flight_request_ids()} {last} pool={controller.gate.pool}"

    await wait_until(idle, within_s, what=left)
    assert engine.load().prefilling == 0
