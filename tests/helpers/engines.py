"""Driving an engine (a prompt, a stream left early) and the simulated or stand-in engines the
tests supervise, hold or ask for supervision."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any, cast

from bench.common import random_prompt as bench_random_prompt
from specrag.pipeline.engines.protocol import (
    Engine,
    EngineOutput,
    Sampling,
    Supervision,
    SupervisionStatus,
    WarmResult,
)
from specrag.pipeline.engines.supervisor import SupervisedEngine, SupervisorPolicy
from specrag.sim.engine import KVEventCallback, SimulatedEngine


def random_prompt(seed: int, length: int) -> list[int]:
    """Token ids of a prompt nothing else shares: the benchmarks' random prompt, drawn from ``seed``."""
    return bench_random_prompt(random.Random(seed), length)


async def run_prompt(
    engine: Engine, prompt: Sequence[int], sampling: Sampling | int = 1, *, request_id: str | None = None
) -> list[EngineOutput]:
    """Every output of one request (``sampling`` as an int is ``max_tokens``); a fresh id by default."""
    if isinstance(sampling, int):
        sampling = Sampling(max_tokens=sampling)
    request_id = request_id or uuid.uuid4().hex
    return [output async for output in engine.generate(request_id, prompt, sampling)]


# Quick to give up on a simulated engine: the fault tests take milliseconds, not minutes.
FAST_POLICY = SupervisorPolicy(probe_timeout_s=0.3, close_timeout_s=1.0, max_attempts=3, backoff_s=0.05)


async def supervised(
    started: list[SimulatedEngine], on_kv_events: KVEventCallback | None = None
) -> SupervisedEngine:
    """A supervised simulated engine; every engine it starts (the first, replacements) joins ``started``
    and publishes its KV events to ``on_kv_events``."""

    async def start() -> SimulatedEngine:
        engine = SimulatedEngine(time_scale=0.01, max_model_len=4096, on_kv_events=on_kv_events)
        started.append(engine)
        return engine

    return await SupervisedEngine(start, FAST_POLICY).start()


async def close_stream(stream: AsyncIterator[Any]) -> None:
    """Leave an engine's output stream early (the protocol types it as an iterator; it is a generator)."""
    await cast(AsyncGenerator[Any, None], stream).aclose()


class StandInSupervision:
    """A supervisor that is no SupervisedEngine: the controller and the service must still find it."""

    def __init__(self) -> None:
        self.reports: list[str] = []
        self.waits = 0

    def status(self) -> SupervisionStatus:
        return SupervisionStatus(state="ready", restarts=3, last_recovery_s=1.5)

    def report_failure(self, reason: str) -> None:
        self.reports.append(reason)

    async def wait_ready(self, timeout_s: float) -> bool:
        self.waits += 1
        return True


class SupervisedSimulation(SimulatedEngine):
    """The simulated engine offering a supervision capability."""

    def __init__(self, supervision: StandInSupervision) -> None:
        super().__init__(time_scale=0.01, max_model_len=4096)
        self._supervision = supervision

    @property
    def supervision(self) -> Supervision | None:
        return self._supervision


class HeldWarmEngine(SimulatedEngine):
    """The simulated engine whose warm-ups wait until the test lets them finish."""

    def __init__(self) -> None:
        super().__init__(time_scale=0.01, max_model_len=4096)
        self.release_warm = asyncio.Event()
        self.warm_returned = asyncio.Event()

    async def warm(self, prompt_token_ids: Sequence[int], request_id: str) -> WarmResult:
        await self.release_warm.wait()
        result = await super().warm(prompt_token_ids, request_id)
        self.warm_returned.set()  # the warmer records the result before the test wakes up
        return result
