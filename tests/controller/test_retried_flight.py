"""RetriedFlight, the one retry policy of the controller's answers and bench.scale's replays.

On simulated replicas: a failure before the first token is resubmitted on another replica (the
failed one excluded), a failure after it is not, the retries are bounded, and with no engine in
service the caller gets a 503-type error instead of waiting.
"""

from __future__ import annotations

import pytest

from specrag.cache.layout import PromptLayout, build_layout
from specrag.controller.flight import Flight, RetriedFlight
from specrag.controller.gate import PrefillGate
from specrag.controller.placement import Placed, Placement
from specrag.controller.replicas import Replica
from specrag.errors import EngineError, EngineUnavailableError
from specrag.pipeline.engine import EngineOutput, Sampling
from specrag.pipeline.simulated_engine import SimulatedEngine
from tests.helpers import random_prompt

SYSTEM = tuple(range(3, 67))  # two blocks of 32


def prompt() -> PromptLayout:
    documents = [(1, tuple(random_prompt(1, 40))), (2, tuple(random_prompt(2, 40)))]
    return build_layout(SYSTEM, documents, (7, 8, 9), block_size=32, pad_token_id=0)


def simulated(replica: Replica) -> SimulatedEngine:
    engine = replica.engine
    assert isinstance(engine, SimulatedEngine)
    return engine


class Launcher:
    """Launches flights through an unbounded gate and records every resubmission."""

    def __init__(self, max_tokens: int = 4) -> None:
        self.gate = PrefillGate(1 << 20, 0.0)
        self.sampling = Sampling(max_tokens=max_tokens)
        self.resubmitted: list[tuple[str, str]] = []  # (failed replica, new replica)

    def launch(self, placed: Placed) -> Flight:
        slot = self.gate.try_speculate()
        assert slot is not None
        return Flight(placed, self.sampling, slot, speculative=False)

    async def resubmit(self, placed: Placed, failed: Flight, error: EngineError) -> Flight:
        self.resubmitted.append((failed.replica.name, placed.replica.name))
        await failed.abort()
        return self.launch(placed)


async def collect(answer: RetriedFlight) -> list[EngineOutput]:
    try:
        return [output async for output in answer.outputs()]
    finally:
        await answer.flight.abort()


async def close(replicas: list[Replica]) -> None:
    for replica in replicas:
        await replica.engine.close()


def pool(n: int) -> list[Replica]:
    return [Replica.simulated(f"r{i}", SYSTEM, time_scale=0.01, max_model_len=4096) for i in range(n)]


async def test_a_failure_before_the_first_token_is_resubmitted_on_another_replica() -> None:
    replicas = pool(2)
    placement = Placement(replicas, router="round_robin")
    launcher = Launcher()
    placed = placement.place_prompt(prompt())
    simulated(placed.replica).fail_next()
    answer = RetriedFlight(launcher.launch(placed), placement, 5.0, launcher.resubmit)
    outputs = await collect(answer)
    (other,) = [r for r in replicas if r is not placed.replica]
    assert launcher.resubmitted == [(placed.replica.name, other.name)]
    assert answer.flight.replica is other and outputs[-1].finished
    assert placed.replica.excluded is not None and other.excluded is None
    await close(replicas)


async def test_a_failure_after_the_first_token_is_raised_not_retried() -> None:
    replicas = pool(2)
    placement = Placement(replicas)
    launcher = Launcher(max_tokens=400)
    placed = placement.place_prompt(prompt())
    answer = RetriedFlight(launcher.launch(placed), placement, 5.0, launcher.resubmit)
    seen = 0
    with pytest.raises(EngineError):
        async for _ in answer.outputs():
            seen += 1
            if seen == 1:
                await simulated(placed.replica).die()
    await answer.flight.abort()
    assert seen >= 1 and launcher.resubmitted == [] and answer.flight.replica is placed.replica
    await close(replicas)


async def test_retries_are_bounded_by_the_other_replicas() -> None:
    replicas = pool(2)
    placement = Placement(replicas)
    launcher = Launcher()
    for replica in replicas:
        simulated(replica).fail_next(1, EngineError("injected"))
    placed = placement.place_prompt(prompt())
    answer = RetriedFlight(launcher.launch(placed), placement, 5.0, launcher.resubmit)
    with pytest.raises(EngineError, match="injected"):
        await collect(answer)
    assert len(launcher.resubmitted) == 1  # one other replica: one retry
    await close(replicas)


async def test_with_no_engine_in_service_the_caller_is_told_to_retry_shortly() -> None:
    replicas = pool(2)
    placement = Placement(replicas)
    launcher = Launcher()
    placed = placement.place_prompt(prompt())
    (other,) = [r for r in replicas if r is not placed.replica]
    other.exclude("down for the test")
    simulated(placed.replica).fail_next()
    answer = RetriedFlight(launcher.launch(placed), placement, 0.2, launcher.resubmit)
    with pytest.raises(EngineUnavailableError, match="no engine in service"):
        await collect(answer)
    assert launcher.resubmitted == []
    await close(replicas)


async def test_a_single_replica_is_retried_once_on_itself() -> None:
    replicas = pool(1)
    placement = Placement(replicas)
    launcher = Launcher()
    simulated(replicas[0]).fail_next()
    answer = RetriedFlight(
        launcher.launch(placement.place_prompt(prompt())), placement, 5.0, launcher.resubmit
    )
    assert (await collect(answer))[-1].finished
    assert launcher.resubmitted == [("r0", "r0")] and replicas[0].excluded is None
    await close(replicas)
