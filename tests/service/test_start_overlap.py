"""``serve``'s engine starts from the verified model directory while the other artefacts are
checked (on the simulated engine, standing in for vLLM's start): an artefact's error still ends
the start with that error, and the engine started for nothing is closed; an error before the
model is verified starts no engine at all."""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from specrag.errors import InvalidInputError
from specrag.pipeline.engines.config import EngineConfig
from specrag.pipeline.engines.protocol import Engine
from specrag.service.run import assembly
from specrag.service.run.assembly import open_service
from specrag.service.run.assets import Assets, check_assets_in_background
from specrag.service.run.options import ServiceOptions
from specrag.sim.engine import SimulatedEngine


class Started:
    """The simulated engines the service started in place of vLLM, and whether each was closed."""

    def __init__(self) -> None:
        self.engines: list[SimulatedEngine] = []
        self.one_started = threading.Event()  # waited for by the artefacts' thread

    def starter(
        self, config: EngineConfig, pin_to: frozenset[int] | None = None
    ) -> Callable[[], Awaitable[Engine]]:
        async def start() -> Engine:
            engine = SimulatedEngine(time_scale=0.01, max_model_len=4096)
            self.engines.append(engine)
            self.one_started.set()
            return engine

        return start


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> Started:
    started = Started()
    monkeypatch.setattr(assembly, "starter", started.starter)
    return started


async def test_an_artefact_error_after_the_engine_started_ends_the_start_and_closes_the_engine(
    started: Started, tiny_model_dir: Path, tmp_path: Path
) -> None:
    def check(model_verified: Callable[[Path], None]) -> Assets:
        model_verified(tiny_model_dir)
        # Still checking the index when the engine starts: it started from the model alone.
        assert started.one_started.wait(timeout=30), "the engine waited for every artefact"
        raise InvalidInputError("the index was embedded by another embedder")

    checking = await check_assets_in_background(check)
    assert checking.model_dir == tiny_model_dir
    with pytest.raises(InvalidInputError, match="another embedder"):
        async with open_service(checking, ServiceOptions(), tmp_path / "run"):
            pytest.fail("served without its artefacts")
    assert len(started.engines) == 1 and started.engines[0].closed
    checking.close()  # nothing to close: the check failed


async def test_an_error_before_the_model_is_verified_starts_no_engine(started: Started) -> None:
    def check(model_verified: Callable[[Path], None]) -> Assets:
        raise InvalidInputError("the corpus lost passages")

    with pytest.raises(InvalidInputError, match="lost passages"):
        await check_assets_in_background(check)
    assert started.engines == []
