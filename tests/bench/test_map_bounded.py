"""bench.common.map_bounded: answers asked together come back in the questions' order, never
more at once than the limit, and a failure stops the rest."""

from __future__ import annotations

import asyncio

import pytest

from bench.common import map_bounded


async def test_results_keep_the_items_order_when_they_finish_out_of_order() -> None:
    running = 0
    most = 0

    async def work(item: int) -> int:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await asyncio.sleep(0.001 * (10 - item))  # later items finish first
        running -= 1
        return item * item

    assert await map_bounded(work, list(range(10)), limit=3) == [item * item for item in range(10)]
    assert most == 3


async def test_the_first_failure_is_raised_and_the_rest_cancelled() -> None:
    cancelled = []

    async def work(item: int) -> int:
        if item == 0:
            raise ValueError("no")
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(item)
            raise
        return item

    with pytest.raises(ValueError, match="no"):
        await asyncio.wait_for(map_bounded(work, [0, 1, 2], limit=3), timeout=5)
    assert sorted(cancelled) == [1, 2]


async def test_a_limit_below_one_is_refused() -> None:
    async def work(item: int) -> int:
        return item

    with pytest.raises(ValueError, match="at least 1"):
        await map_bounded(work, [1], limit=0)
