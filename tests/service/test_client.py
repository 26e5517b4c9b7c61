"""The async client against the real service, and its error mapping (HTTP, timeouts, no service)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from aiohttp import web

import specrag
from specrag.client import (
    AsyncClient,
    ChatStream,
    RagAnswer,
    SpecragConnectionError,
    SpecragHTTPError,
    SpecragTimeoutError,
)
from specrag.controller.controller import RagController
from specrag.errors import SpecragError
from specrag.pipeline.engines.vllm_engine import VllmEngine
from specrag.service.http.access import Access
from specrag.service.http.app import serving
from specrag.service.run.assets import Assets
from tests.helpers.builders import QUESTION, make_controller
from tests.helpers.http import TOKEN, free_port, metric, running
from tests.helpers.waiting import assert_engine_idle

pytestmark = pytest.mark.engine


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def service(vllm_engine: VllmEngine, tiny_assets: Assets) -> AsyncIterator[tuple[str, RagController]]:
    controller = make_controller(vllm_engine, tiny_assets)
    async with running(controller, Access(tokens=(TOKEN,))) as url:
        yield url, controller


@pytest_asyncio.fixture(loop_scope="session")
async def client(service: tuple[str, RagController]) -> AsyncIterator[AsyncClient]:
    async with AsyncClient(service[0], api_token=TOKEN, timeout_s=120) as client:
        yield client


def test_the_client_is_exported_by_the_package() -> None:
    assert specrag.AsyncClient is AsyncClient and specrag.SpecragHTTPError is SpecragHTTPError
    with pytest.raises(AttributeError):
        _ = specrag.NoSuchThing


async def test_health_rag_and_metrics(client: AsyncClient) -> None:
    assert (await client.health())["status"] == "ok"
    answer = await client.rag(QUESTION, k=4, max_tokens=3)
    assert isinstance(answer, RagAnswer) and len(answer.documents) == 4
    assert answer.timeline["ttft_ms"] > 0 and answer.timeline["documents"] == answer.documents
    text = await client.metrics_text()
    assert metric(text, "specrag_requests_total", mode="all", outcome="ok") >= 1


async def test_a_streamed_answer_gives_text_then_the_timeline(client: AsyncClient) -> None:
    async with client.stream_rag(QUESTION, k=4, max_tokens=5) as stream:
        deltas = [text async for text in stream]
    assert deltas and "".join(deltas) == stream.answer
    assert stream.timeline is not None and stream.timeline["ttft_ms"] > 0
    assert stream.documents is not None
    assert stream.documents == stream.timeline["documents"] and len(stream.documents) == 4


async def test_chat_plain_and_streamed(client: AsyncClient) -> None:
    messages = [{"role": "user", "content": QUESTION}]
    completion = await client.chat(messages, max_tokens=3, k=4)
    assert completion["object"] == "chat.completion" and completion["specrag"]["adopted"] in {True, False}
    stream = await client.chat(messages, stream=True, max_tokens=3, k=4)
    assert isinstance(stream, ChatStream)
    async with stream:
        chunks = [chunk async for chunk in stream]
    assert chunks[-1]["choices"][0]["finish_reason"] in {"stop", "length"}
    assert stream.timeline == chunks[-1]["specrag"]
    assert stream.timeline is not None
    assert stream.timeline["documents"] == completion["specrag"]["documents"]


async def test_sessions_open_and_close(client: AsyncClient, service: tuple[str, RagController]) -> None:
    session_id = await client.create_session()
    await client.rag(QUESTION, k=4, max_tokens=2, session_id=session_id)
    assert service[1].sessions.get(session_id, "127.0.0.1").turns == 1
    await client.close_session(session_id)
    with pytest.raises(SpecragHTTPError) as error:
        await client.close_session(session_id)
    assert error.value.status == 404 and error.value.type == "not_found_error"


async def test_http_errors_are_typed(client: AsyncClient, service: tuple[str, RagController]) -> None:
    with pytest.raises(SpecragHTTPError) as error:
        await client.rag("   ")
    assert error.value.status == 400 and error.value.type == "invalid_request_error"
    assert "question is empty" in error.value.message and isinstance(error.value, SpecragError)
    with pytest.raises(SpecragHTTPError, match="k must be an integer") as error:
        async with client.stream_rag(QUESTION, k=0) as stream:
            async for _ in stream:
                pass
    assert error.value.status == 400
    async with AsyncClient(service[0], api_token="wrong") as intruder:
        with pytest.raises(SpecragHTTPError) as error:
            await intruder.rag(QUESTION)
    assert error.value.status == 401 and error.value.code == "invalid_api_key"


async def test_leaving_a_stream_early_aborts_the_query(
    client: AsyncClient, service: tuple[str, RagController], vllm_engine: VllmEngine
) -> None:
    async with client.stream_rag(QUESTION, k=4, max_tokens=1000) as stream:
        async for _ in stream:
            assert service[1].in_flight_request_ids()
            break
    assert stream.timeline is None
    await assert_engine_idle(vllm_engine, service[1])


@pytest_asyncio.fixture(loop_scope="session")
async def silent_service() -> AsyncIterator[str]:
    """A loopback server that never answers: for the client's timeout."""

    async def hang(request: web.Request) -> web.Response:
        await asyncio.sleep(60)
        return web.Response()

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", hang)
    async with serving(app) as url:
        yield url


async def test_a_silent_service_is_a_timeout(silent_service: str) -> None:
    async with AsyncClient(silent_service, timeout_s=0.3) as client:
        with pytest.raises(SpecragTimeoutError, match=r"nothing received for 0\.3 s"):
            await client.health()
        with pytest.raises(SpecragTimeoutError):
            async for _ in client.stream_rag(QUESTION):
                pass


async def test_no_service_is_a_connection_error() -> None:
    async with AsyncClient(f"http://127.0.0.1:{free_port()}") as client:
        with pytest.raises(SpecragConnectionError):
            await client.health()


async def test_a_non_json_error_body_still_gives_a_typed_error() -> None:
    async def teapot(request: web.Request) -> web.Response:
        return web.Response(status=418, text="short and stout")

    app = web.Application()
    app.router.add_get("/health", teapot)
    async with serving(app) as url, AsyncClient(url) as client:
        with pytest.raises(SpecragHTTPError) as error:
            await client.health()
    assert error.value.status == 418 and error.value.message == "short and stout"
