"""The HTTP engine against a fake OpenAI-compatible server on loopback, and once against real vLLM."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web

from specrag.errors import EngineError, InvalidInputError
from specrag.pipeline.engines.http_engine import HttpEngine, HttpTimeouts
from specrag.pipeline.engines.protocol import Engine, Sampling
from tests.helpers.engines import close_stream, random_prompt, run_prompt
from tests.helpers.http import EngineServer, free_port
from tests.helpers.waiting import wait_until

METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="fake"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="fake"} 3.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="100"} 1.0
"""


class FakeServer:
    """Streams like vLLM's /v1/completions; the prompt's first token picks the behaviour."""

    NORMAL, NO_DETAILS, ENDLESS, HANG, SERVER_ERROR, TOO_LONG, MID_STREAM_STALL, BURST = range(1, 9)

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.disconnected = asyncio.Event()
        self.release = asyncio.Event()
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/completions", self.completions)
        # Cancel a handler when its client disconnects (that is how the fake notices an abort),
        # and do not wait a minute for handlers that are still sleeping at teardown.
        self.runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake", "max_model_len": 2048}]})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=METRICS)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        mode = body["prompt"][0]
        if mode == self.SERVER_ERROR:
            return web.json_response({"error": {"message": "engine exploded", "code": 500}}, status=500)
        if mode == self.TOO_LONG:
            message = "This model's maximum context length is 2048 tokens."
            return web.json_response({"error": {"message": message, "code": 400}}, status=400)
        if mode == self.HANG:
            await asyncio.sleep(60)
        if mode == self.BURST:
            return await self.burst(request, body)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            count = 10_000 if mode == self.ENDLESS else body["max_tokens"]
            for index in range(count):
                last = index == count - 1
                choice = {"index": 0, "text": f" w{index}", "token_ids": [100 + index]}
                choice["finish_reason"] = "length" if last else None
                usage: dict[str, Any] = {"prompt_tokens": len(body["prompt"]), "completion_tokens": index + 1}
                await self.send(response, {"choices": [choice], "usage": usage})
                if mode == self.MID_STREAM_STALL:
                    await asyncio.sleep(60)
                if mode == self.ENDLESS:
                    await asyncio.sleep(0.02)
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": count}
            if mode != self.NO_DETAILS:
                usage["prompt_tokens_details"] = {"cached_tokens": 64}
            await self.send(response, {"choices": [], "usage": usage})
            await response.write(b"data: [DONE]\n\n")
        except (ConnectionResetError, asyncio.CancelledError):
            self.disconnected.set()
            raise
        return response

    async def burst(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        """The first token alone, then (once the test has it) every other event in one write."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        count = body["max_tokens"]
        events: list[dict[str, Any]] = [
            {"choices": [{"index": 0, "text": f" w{i}", "token_ids": [100 + i], "finish_reason": None}]}
            for i in range(count)
        ]
        events[-1]["choices"][0]["finish_reason"] = "length"
        events.append({"choices": [], "usage": {"prompt_tokens_details": {"cached_tokens": 64}}})
        lines = [f"data: {json.dumps(event)}\n\n".encode() for event in events] + [b"data: [DONE]\n\n"]
        await response.write(lines[0])
        await asyncio.wait_for(self.release.wait(), timeout=5)
        await response.write(b"".join(lines[1:]))
        return response

    @staticmethod
    async def send(response: web.StreamResponse, event: dict[str, Any]) -> None:
        # Split mid-line on purpose: the client must reassemble SSE lines across reads.
        data = f"data: {json.dumps(event)}\n\n".encode()
        await response.write(data[:7])
        await response.write(data[7:])


@pytest_asyncio.fixture(loop_scope="session")
async def fake() -> AsyncIterator[FakeServer]:
    server = FakeServer()
    await server.start()
    try:
        yield server
    finally:
        assert server.runner is not None
        await server.runner.cleanup()


@pytest_asyncio.fixture(loop_scope="session")
async def engine(fake: FakeServer) -> AsyncIterator[HttpEngine]:
    timeouts = HttpTimeouts(connect_s=2, first_token_s=1.0, between_chunks_s=0.5, control_s=2)
    engine = await HttpEngine.connect(fake.url, api_key="secret", timeouts=timeouts)
    try:
        yield engine
    finally:
        await engine.close()


async def test_discovers_the_model_limit_and_block_size(engine: HttpEngine) -> None:
    assert isinstance(engine, Engine)
    assert (engine.model, engine.max_model_len, engine.block_size) == ("fake", 2048, 32)
    assert engine.kv_capacity_tokens == 3200
    assert (await engine.counts()).__dict__ == {"running": 2, "waiting": 3, "unfinished": 5}


async def test_streams_tokens_and_reports_cached_tokens_on_the_last_output(
    engine: HttpEngine, fake: FakeServer
) -> None:
    outputs = await run_prompt(engine, [FakeServer.NORMAL, 5, 6, 7], 3)
    # Events read together come as one increment: how many there are depends on the reads.
    assert [token for output in outputs for token in output.token_ids] == [100, 101, 102]
    assert "".join(output.text for output in outputs) == " w0 w1 w2"
    assert [output.cached_tokens for output in outputs[:-1]] == [None] * (len(outputs) - 1)
    assert outputs[-1].cached_tokens == 64 and outputs[-1].token_ids == (102,)
    assert [output.finished for output in outputs] == [False] * (len(outputs) - 1) + [True]
    assert outputs[-1].finish_reason == "length" and outputs[0].prompt_tokens == 4
    body = fake.bodies[-1]
    assert body["prompt"] == [FakeServer.NORMAL, 5, 6, 7] and body["model"] == "fake"
    assert body["stream"] is True and body["stream_options"]["include_usage"] is True
    assert engine.load().prefilling == 0 and engine.load().decoding == 0
    warm = await engine.warm([FakeServer.NORMAL, 8, 9], "warm-1")
    assert warm.cached_tokens == 64 and warm.block_size == 32


async def test_penalties_are_sent_only_when_set(engine: HttpEngine, fake: FakeServer) -> None:
    assert engine.honours_penalties
    penalised = Sampling(max_tokens=2, frequency_penalty=0.4, presence_penalty=-0.5, repetition_penalty=1.2)
    await run_prompt(engine, [FakeServer.NORMAL, 5], penalised)
    body = fake.bodies[-1]
    assert (body["frequency_penalty"], body["presence_penalty"], body["repetition_penalty"]) == (
        0.4,
        -0.5,
        1.2,
    )
    await run_prompt(engine, [FakeServer.NORMAL, 5], Sampling(max_tokens=2, repetition_penalty=1.1))
    body = fake.bodies[-1]
    assert body["repetition_penalty"] == 1.1
    assert "frequency_penalty" not in body and "presence_penalty" not in body  # neutral: not sent
    await run_prompt(engine, [FakeServer.NORMAL, 5], 2)
    assert not {"frequency_penalty", "presence_penalty", "repetition_penalty"} & fake.bodies[-1].keys()


async def test_cached_tokens_are_none_when_the_server_does_not_report_them(engine: HttpEngine) -> None:
    outputs = await run_prompt(engine, [FakeServer.NO_DETAILS, 5], 2)
    assert [output.cached_tokens for output in outputs] == [None, None]
    assert (await engine.warm([FakeServer.NO_DETAILS, 6], "warm-2")).cached_tokens == 0


async def test_abort_disconnects_and_ends_the_stream(engine: HttpEngine, fake: FakeServer) -> None:
    fake.disconnected.clear()
    stream = engine.generate("endless", [FakeServer.ENDLESS, 1], Sampling(max_tokens=100))
    first = await anext(stream)
    assert first.token_ids == (100,) and engine.load().decoding == 1
    await engine.abort("endless")
    rest = [output async for output in stream]
    assert rest[-1].finished and rest[-1].finish_reason == "abort"
    await asyncio.wait_for(fake.disconnected.wait(), timeout=5)
    assert engine.load().decoding == 0


async def test_leaving_the_stream_early_disconnects(engine: HttpEngine, fake: FakeServer) -> None:
    fake.disconnected.clear()
    stream = engine.generate("left", [FakeServer.ENDLESS, 2], Sampling(max_tokens=100))
    await anext(stream)
    await close_stream(stream)
    await asyncio.wait_for(fake.disconnected.wait(), timeout=5)
    assert engine.load().decoding == 0


async def test_tokens_read_together_are_one_increment_and_the_first_is_not_held(
    engine: HttpEngine, fake: FakeServer
) -> None:
    fake.release.clear()
    stream = engine.generate("burst", [FakeServer.BURST, 5], Sampling(max_tokens=4))
    try:
        first = await asyncio.wait_for(anext(stream), timeout=5)  # while the server holds the rest
        assert (first.token_ids, first.text, first.finished) == ((100,), " w0", False)
        fake.release.set()
        rest = [output async for output in stream]
    finally:
        await close_stream(stream)
    assert [(output.token_ids, output.text) for output in rest] == [((101, 102), " w1 w2"), ((103,), " w3")]
    assert [(output.finished, output.cached_tokens) for output in rest] == [(False, None), (True, 64)]


async def test_a_request_is_prefilling_until_its_first_chunk(engine: HttpEngine) -> None:
    stream = engine.generate("waiting", [FakeServer.HANG, 4], Sampling(max_tokens=2))
    first = asyncio.ensure_future(anext(stream))
    await asyncio.sleep(0.1)  # the server holds the response back
    assert engine.load().prefilling == 1 and engine.load().decoding == 0
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert engine.load().prefilling == 0 and engine.load().decoding == 0


@pytest.mark.parametrize(
    ("mode", "waiting_for"), [(FakeServer.HANG, "no response"), (FakeServer.MID_STREAM_STALL, "next chunk")]
)
async def test_a_silent_server_times_out_with_engine_error(
    engine: HttpEngine, mode: int, waiting_for: str
) -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(EngineError, match=waiting_for):
        await asyncio.wait_for(run_prompt(engine, [mode, 3], 5), timeout=10)
    assert loop.time() - started < 5  # the engine's own bound (1 s / 0.5 s) fired, not wait_for's
    assert engine.load().prefilling == 0 and engine.load().decoding == 0


async def test_http_errors_carry_status_and_server_message(engine: HttpEngine) -> None:
    with pytest.raises(EngineError, match="HTTP 500: engine exploded"):
        await run_prompt(engine, [FakeServer.SERVER_ERROR], 3)
    with pytest.raises(InvalidInputError, match="HTTP 400: This model's maximum context length"):
        await run_prompt(engine, [FakeServer.TOO_LONG], 3)
    with pytest.raises(InvalidInputError, match="exceeds the model's limit"):
        await run_prompt(engine, [FakeServer.NORMAL] * 2048, 3)
    assert engine.load().prefilling == 0


async def test_a_refused_connection_is_an_engine_error() -> None:
    port = free_port()
    with pytest.raises(EngineError, match=f"127.0.0.1:{port}"):
        await HttpEngine.connect(f"http://127.0.0.1:{port}", timeouts=HttpTimeouts(connect_s=2, control_s=2))


async def test_closed_engine_refuses_work(fake: FakeServer) -> None:
    engine = await HttpEngine.connect(fake.url, model="fake", max_model_len=512, block_size=64)
    assert (engine.max_model_len, engine.block_size) == (512, 64)
    await engine.close()
    await engine.close()
    with pytest.raises(EngineError, match="closed"):
        await run_prompt(engine, [FakeServer.NORMAL], 3)


# The real server ---------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def vllm_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """vLLM's OpenAI server as a subprocess on loopback, started once, always terminated."""
    server = EngineServer(tiny_model_dir, tmp_path_factory.mktemp("vllm-server") / "server.log")
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


@pytest.mark.engine
async def test_real_vllm_server_caches_prefixes_and_aborts(vllm_server: str) -> None:
    engine = await HttpEngine.connect(vllm_server)
    try:
        assert engine.block_size == 32 and engine.max_model_len == 4096
        prompt = random_prompt(seed=40, length=1000)
        first = await run_prompt(engine, prompt, 2)
        second = await run_prompt(engine, prompt, 2)
        assert first[-1].cached_tokens == 0
        assert second[-1].cached_tokens == 992  # every full block but the last is served again
        await engine.reset_prefix_cache()
        assert (await run_prompt(engine, prompt, 1))[-1].cached_tokens == 0

        sampling = Sampling(max_tokens=3000, ignore_eos=True)
        stream = engine.generate("real-abort", prompt[:64], sampling)
        await anext(stream)

        async def running(count: int) -> bool:
            return (await engine.counts()).running == count

        # The server's gauges are its last step's statistics: a loaded machine publishes them late.
        await wait_until(lambda: running(1))
        await engine.abort("real-abort")
        assert [output.finish_reason async for output in stream][-1] == "abort"
        await wait_until(lambda: running(0))
    finally:
        await engine.close()
