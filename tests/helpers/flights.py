"""Answers under :class:`RetriedFlight` on simulated replicas: a pool of them, a prompt to place,
a launcher that records every resubmission, and the answer's outputs collected."""

from __future__ import annotations

from specrag.cache.layout import PromptLayout, build_layout
from specrag.controller.flight import Flight, RetriedFlight
from specrag.controller.gate import PrefillGate
from specrag.controller.placement import Placed
from specrag.controller.replicas import Replica
from specrag.errors import EngineError
from specrag.pipeline.engines.protocol import EngineOutput, Sampling
from specrag.sim.engine import SimulatedEngine
from specrag.sim.replicas import simulated_replica
from tests.helpers.engines import random_prompt

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
        self.sent: list[tuple[int, ...]] = []  # the tokens each resubmission continued from

    def launch(self, placed: Placed, sent: tuple[int, ...] = ()) -> Flight:
        slot = self.gate.try_speculate()
        assert slot is not None
        return Flight(placed, self.sampling, slot, speculative=False, sent=sent)

    async def resubmit(
        self, placed: Placed, failed: Flight, error: EngineError, sent: tuple[int, ...]
    ) -> Flight:
        self.resubmitted.append((failed.replica.name, placed.replica.name))
        self.sent.append(sent)
        await failed.abort()
        return self.launch(placed, sent)


async def collect(answer: RetriedFlight) -> list[EngineOutput]:
    try:
        return [output async for output in answer.outputs()]
    finally:
        await answer.flight.abort()


async def close(replicas: list[Replica]) -> None:
    for replica in replicas:
        await replica.engine.close()


def pool(n: int) -> list[Replica]:
    return [simulated_replica(f"r{i}", SYSTEM, time_scale=0.01, max_model_len=4096) for i in range(n)]
