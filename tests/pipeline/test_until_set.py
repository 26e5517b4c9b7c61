"""``until_set``: a request streaming from an engine that is being shut down fails at once.

Without it, a caller of an engine whose core hung would wait on vLLM's output queue forever.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from specrag.errors import EngineError
from specrag.pipeline.engines.vllm_engine import until_set


async def items_then_silence(items: list[int], silent: asyncio.Event) -> AsyncIterator[int]:
    for item in items:
        yield item
    await silent.wait()  # a hung engine: never another output
    yield -1


async def test_items_pass_through_until_the_stream_ends() -> None:
    async def finite() -> AsyncIterator[int]:
        for item in (1, 2, 3):
            yield item

    received = [item async for item in until_set(finite(), asyncio.Event())]
    assert received == [1, 2, 3]


async def test_setting_the_event_fails_a_silent_stream_promptly() -> None:
    stop = asyncio.Event()
    received: list[int] = []

    async def consume() -> None:
        async for item in until_set(items_then_silence([7, 8], asyncio.Event()), stop):
            received.append(item)

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.05)
    assert received == [7, 8] and not task.done()  # waiting on the silent engine
    stop.set()
    with pytest.raises(EngineError, match="shut down"):
        await asyncio.wait_for(task, timeout=2.0)


async def test_an_event_set_before_the_first_item_fails_at_once() -> None:
    stop = asyncio.Event()
    stop.set()
    with pytest.raises(EngineError):
        async for _ in until_set(items_then_silence([], asyncio.Event()), stop):
            pass
