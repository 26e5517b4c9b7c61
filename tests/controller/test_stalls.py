"""Every stall is bounded: a stream with no token for ``inter_token_timeout_s`` after its first one
moves to a recovered engine, or ends with a clear error; its engine request is aborted. The
simulated engine's ``stall`` freezes its step loop, as a hung engine core would; the one
engine-marked test stops the real one with SIGSTOP."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from typing import Any

import aiohttp
import pytest

from specrag.cli import build_parser
from specrag.controller.config import ControllerConfig
from specrag.controller.controller import RagController
from specrag.controller.query import AnswerDelta, AnswerDone, RagRequest
from specrag.errors import EngineError, InvalidInputError
from specrag.pipeline.engines.vllm_engine import VllmEngine
from specrag.service.cli.commands import _controller_config
from specrag.service.run.assets import Assets
from specrag.sim.engine import SimulatedEngine
from tests.helpers.builders import QUESTION, A, make_controller, scripted_index
from tests.helpers.engines import supervised
from tests.helpers.http import running, sse_events
from tests.helpers.waiting import assert_engine_idle

INTER_TOKEN_S = 0.3
FIRST_TOKEN_S = 0.5
# Room for the probe (FAST_POLICY: 0.3 s), the restart and a loaded test machine.
MARGIN_S = 1.5


def request(max_tokens: int = 300) -> RagRequest:
    return RagRequest(QUESTION, k=3, mode="serial", max_tokens=max_tokens)


def controller_on(engine: SimulatedEngine | object, assets: Assets) -> RagController:
    return make_controller(
        engine,  # type: ignore[arg-type]
        assets,
        scripted_index(assets, [A, A], 0.01),
        first_token_timeout_s=FIRST_TOKEN_S,
        inter_token_timeout_s=INTER_TOKEN_S,
    )


async def test_a_stream_stalled_after_its_first_token_moves_to_the_recovered_engine(
    tiny_assets: Assets,
) -> None:
    started: list[SimulatedEngine] = []
    engine = await supervised(started)
    controller = controller_on(engine, tiny_assets)
    gaps: list[float] = []
    async with contextlib.aclosing(controller.stream(request())) as events:
        assert isinstance(await anext(events), AnswerDelta)
        started[0].stall()  # the engine hangs mid-answer; the supervisor still says "ready"
        last = time.perf_counter()
        async for event in events:
            gaps.append(time.perf_counter() - last)
            last = time.perf_counter()
            done = event
    assert isinstance(done, AnswerDone) and done.finish_reason == "length"
    migrations = [e for e in done.timeline.events if e.kind == "migrate"]
    assert len(migrations) == 1 and "stalled" in migrations[0].detail["reason"]
    assert max(gaps) < INTER_TOKEN_S + MARGIN_S  # the stream went on within its timeout (and a restart)
    assert engine.restarts == 1 and len(started) == 2  # the stall reached the supervisor
    await assert_engine_idle(started[1], controller)
    await controller.close()
    await engine.close()


async def test_a_stalled_stream_with_nowhere_to_go_ends_with_a_clear_error(tiny_assets: Assets) -> None:
    engine = SimulatedEngine(time_scale=0.01, max_model_len=4096)
    controller = controller_on(engine, tiny_assets)
    async with contextlib.aclosing(controller.stream(request())) as events:
        assert isinstance(await anext(events), AnswerDelta)
        engine.stall()
        began = time.perf_counter()
        with pytest.raises(EngineError, match=r"stalled|no first token"):
            async for _ in events:
                pass
    # The stall's timeout, then the one move's (onto the same, still stalled engine) first-token one.
    assert time.perf_counter() - began < INTER_TOKEN_S + FIRST_TOKEN_S + MARGIN_S
    engine.resume()
    await assert_engine_idle(engine, controller)  # every engine request of the answer was aborted
    await controller.close()
    await engine.close()


async def test_a_streamed_answer_that_stalls_ends_with_an_error_event(tiny_assets: Assets) -> None:
    engine = SimulatedEngine(time_scale=0.01, max_model_len=4096)
    controller = controller_on(engine, tiny_assets)
    body = {"query": QUESTION, "k": 3, "mode": "serial", "max_tokens": 300, "stream": True}
    async with running(controller) as url, aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/rag", json=body) as response:
            assert response.status == 200
            await response.content.readuntil(b"\n\n")  # the first delta
            engine.stall()
            began = time.perf_counter()
            text = (await response.content.read()).decode()
        assert time.perf_counter() - began < INTER_TOKEN_S + FIRST_TOKEN_S + MARGIN_S
        event, data = sse_events(text)[-1]
        error = json.loads(data)
        assert event == "error" and error["status"] in (502, 503, 504), error
        assert "stalled" in error["error"]["message"] or "first token" in error["error"]["message"]
        engine.resume()
        await assert_engine_idle(engine, controller)
    await engine.close()


def test_the_inter_token_timeout_is_set_by_the_command_line_and_checked() -> None:
    config = _controller_config(build_parser().parse_args(["serve", "--inter-token-timeout", "2.5"]))
    assert config.inter_token_timeout_s == 2.5
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(InvalidInputError, match="inter_token_timeout_s must be positive"):
            ControllerConfig(inter_token_timeout_s=bad)


def engine_core_pid(engine: VllmEngine) -> int:
    """The engine-core process of an in-process vLLM engine (from vLLM's process manager)."""
    client = getattr(engine._llm, "engine_core", None)
    manager = getattr(getattr(client, "resources", None), "engine_manager", None)
    processes: list[Any] = list(getattr(manager, "processes", ()))
    assert len(processes) == 1
    return int(processes[0].pid)


@pytest.mark.engine
async def test_a_real_engine_stalled_mid_answer_ends_the_answer_and_keeps_nothing(
    vllm_engine: VllmEngine, tiny_assets: Assets
) -> None:
    """SIGSTOP of vLLM's engine core after the first token: the answer ends within its timeouts
    (the stall's, then the one move's first-token one, onto the same stopped engine), and once the
    core runs again no request of the answer is left in it."""
    controller = make_controller(
        vllm_engine,
        tiny_assets,
        scripted_index(tiny_assets, [A, A], 0.01),
        first_token_timeout_s=3.0,
        inter_token_timeout_s=1.0,
    )
    pid = engine_core_pid(vllm_engine)
    try:
        async with contextlib.aclosing(controller.stream(request(max_tokens=1000))) as events:
            assert isinstance(await anext(events), AnswerDelta)
            os.kill(pid, signal.SIGSTOP)
            began = time.perf_counter()
            with pytest.raises(EngineError, match=r"stalled|no first token"):
                async for _ in events:
                    pass
            assert time.perf_counter() - began < 1.0 + 3.0 + 10.0
    finally:
        os.kill(pid, signal.SIGCONT)
    await assert_engine_idle(vllm_engine, controller, within_s=30)
    await controller.close()
