"""bench.capacity.profile's sampler: stacks charged to the right component, CPU charged where spent."""

from __future__ import annotations

import asyncio
import sys
import time
from types import FrameType

from bench.capacity.profile_sampler import NATIVE, FrameSampler, classify
from specrag.sim.engine import SimulatedEngine
from tests.helpers.engines import run_prompt


def test_a_stack_is_charged_to_the_first_rule_any_of_its_frames_matches() -> None:
    """The simulated engine's KV events reach the tree through a callback: the stack holds the
    cache's frames below the engine's, and the engine stand-in is what it is charged to."""
    seen: list[FrameType] = []

    def capture(events: object) -> None:
        seen.append(sys._getframe())

    async def one_prompt() -> None:
        engine = SimulatedEngine(time_scale=0, on_kv_events=capture)
        await run_prompt(engine, list(range(3, 100)))
        await engine.close()

    asyncio.run(one_prompt())
    assert seen and classify(seen[0]) == "engine stand-in"
    assert classify(sys._getframe()) == "other"  # a test's own frames belong to no component


def test_the_cpu_a_busy_main_thread_spends_is_charged_to_its_stack() -> None:
    with FrameSampler(interval_s=0.001) as sampler:
        deadline = time.thread_time() + 0.2
        while time.thread_time() < deadline:
            sum(range(1000))
    profile = sampler.profile
    assert profile.samples > 10
    charged = sum(s for component, s in profile.by_component.items() if component != NATIVE)
    assert charged > 0.1  # of the 0.2 s spent, most was seen (ticks come per CPU interval)
    assert any("test_capacity_profile.py" in site for site in profile.self_sites)
