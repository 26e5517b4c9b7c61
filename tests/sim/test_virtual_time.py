"""Virtual time: sleeps end exactly on time, computation takes none, now() reads the same clock."""

from __future__ import annotations

import asyncio
import time

from specrag.pipeline.engines.protocol import Sampling, now
from specrag.sim import virtual_time
from specrag.sim.engine import SimulatedEngine
from specrag.sim.requests import TimeModel


def test_sleeps_advance_the_clock_exactly_and_computation_does_not() -> None:
    async def main() -> tuple[float, float, float, float]:
        start = now()
        await asyncio.sleep(3600.0)  # an hour of virtual time
        after_sleep = now()
        deadline = time.perf_counter() + 0.05
        while time.perf_counter() < deadline:  # 50 ms of real computation
            pass
        after_work = now()
        await asyncio.gather(asyncio.sleep(2.0), asyncio.sleep(5.0))
        return start, after_sleep, after_work, now()

    wall = time.perf_counter()
    start, after_sleep, after_work, end = virtual_time.run(main())
    assert time.perf_counter() - wall < 60  # the hour was not slept
    assert after_sleep - start == 3600.0
    assert after_work == after_sleep
    assert end - after_work == 5.0


def test_now_is_the_real_clock_again_afterwards() -> None:
    async def inside() -> float:
        return now()

    assert virtual_time.run(inside()) == 0.0
    before = time.perf_counter()
    assert before <= now() <= time.perf_counter()


def test_a_simulated_engines_first_token_comes_exactly_when_its_time_model_says() -> None:
    """One 100-token prompt on an idle engine: one step, its overhead plus the prefill's cost."""
    model = TimeModel()

    async def main() -> float:
        engine = SimulatedEngine(time_model=model)
        submitted = now()
        prompt = list(range(3, 103))
        outputs = [output async for output in engine.generate("r", prompt, Sampling(max_tokens=1))]
        await engine.close()
        return outputs[0].received_at - submitted

    expected = model.step_overhead_s + model.prefill.cost(0, 100)
    assert abs(virtual_time.run(main()) - expected) < 1e-9
