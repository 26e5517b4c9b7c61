"""A started service's heap is frozen (kept out of full collections) while it serves, and given
back to the collector when it stops; the serving assembly does it for every service."""

from __future__ import annotations

import gc
import weakref

from specrag.service.run.assembly import serving_engines
from specrag.service.run.assets import Assets
from specrag.service.run.heap import frozen_heap
from specrag.service.run.options import ServiceOptions
from specrag.service.run.pools import PoolEngine
from specrag.sim.engine import SimulatedEngine


class Cycle:
    """An object in a reference cycle: only the collector frees it."""

    def __init__(self) -> None:
        self.me = self


def test_the_heap_alive_at_the_start_is_frozen_its_garbage_collected_first() -> None:
    garbage, kept = Cycle(), Cycle()
    freed = weakref.ref(garbage)
    del garbage
    with frozen_heap():
        assert freed() is None  # collected, not frozen
        assert gc.get_freeze_count() > 0
        assert not any(item is kept for item in gc.get_objects())  # collections skip it
    assert gc.get_freeze_count() == 0
    assert any(item is kept for item in gc.get_objects())


async def test_a_service_serves_with_its_start_frozen_and_unfreezes_when_it_stops(
    tiny_assets: Assets,
) -> None:
    engine = SimulatedEngine(time_scale=0.01, max_model_len=4096)
    try:
        async with serving_engines([PoolEngine("0", engine, None)], tiny_assets, ServiceOptions()):
            assert gc.get_freeze_count() > 0
        assert gc.get_freeze_count() == 0
    finally:
        await engine.close()
