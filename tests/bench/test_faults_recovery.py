"""bench.faults' wait for recovery: bounded, and a run that gives up says what it last saw."""

from __future__ import annotations

from typing import Any

import pytest

import bench.faults.scenarios as scenarios
from bench.faults.outcomes import Run
from specrag.client import SpecragHTTPError


class FullQueueClient:
    """A service whose engine was replaced but whose prefill pool stays full: every query is refused."""

    async def health(self) -> dict[str, Any]:
        return {"status": "ok", "engine_restarts": 2, "engine_state": "ready", "prefill_pool": 1, "queued": 6}

    async def rag(self, question: str, **options: Any) -> None:
        raise SpecragHTTPError(429, "6 requests already wait for the engine (limit 6)", "overloaded")


async def test_a_service_that_does_not_recover_is_reported_with_its_last_health_and_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(scenarios, "RECOVERY_BOUND_S", 0.3)
    with pytest.raises(RuntimeError, match="did not recover within") as failure:
        await scenarios.wait_recovered(FullQueueClient(), None, 1, Run())  # type: ignore[arg-type]
    message = str(failure.value)
    assert "prefill_pool 1" in message and "queued 6" in message and "engine_restarts 2" in message
    assert "HTTP 429" in message and "already wait for the engine" in message
