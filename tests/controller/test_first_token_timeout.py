"""The first-token timeout bounds what the caller waits.

A prompt that a working engine did not prefill within the timeout is not asked again of the same
engine: that would take as long again, and the caller would wait twice the timeout (a
4,000-character question once waited 122 s against a 60 s timeout). A hung engine that its
supervisor replaced, or another replica, still gets the retry (tests/controller/test_faults.py,
test_scale_out.py).
"""

from __future__ import annotations

import pytest

from specrag.controller.flight import RetriedFlight
from specrag.controller.placement import Placement
from specrag.errors import EngineTimeoutError
from tests.helpers.flights import Launcher, close, collect, pool, prompt, simulated


async def test_a_prompt_a_working_engine_did_not_prefill_in_time_is_not_asked_again() -> None:
    replicas = pool(1)
    placement = Placement(replicas)
    launcher = Launcher()
    simulated(replicas[0]).stall()  # as slow as a prefill longer than the timeout
    answer = RetriedFlight(
        launcher.launch(placement.place_prompt(prompt())),
        placement,
        0.2,
        launcher.resubmit,
        inter_token_timeout_s=5.0,
    )
    with pytest.raises(EngineTimeoutError, match=r"first-token timeout of 0.2 s.*smaller k"):
        await collect(answer)
    assert launcher.resubmitted == []
    simulated(replicas[0]).resume()
    await close(replicas)
