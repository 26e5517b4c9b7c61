"""The HTTP service on the real engine, spoken to over loopback HTTP with a plain aiohttp client."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import pytest_asyncio

from specrag.controller.controller import RagController, RagRequest
from specrag.pipeline.engines.vllm_engine import VllmEngine
from specrag.service.http.access import Access
from specrag.service.run.assets import Assets
from tests.helpers.builders import QUESTION, A, B, make_controller, scripted_index
from tests.helpers.http import TOKEN, metric, running, sse_events
from tests.helpers.waiting import assert_engine_idle

pytestmark = pytest.mark.engine

AUTH = {"Authorization": f"Bearer {TOKEN}"}
MAX_BODY = 16 * 1024


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def service(vllm_engine: VllmEngine, tiny_assets: Assets) -> AsyncIterator[tuple[str, RagController]]:
    controller = make_controller(vllm_engine, tiny_assets)
    async with running(controller, Access(tokens=(TOKEN,)), max_body_bytes=MAX_BODY) as url:
        yield url, controller


@pytest_asyncio.fixture(loop_scope="session")
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(headers=AUTH, timeout=aiohttp.ClientTimeout(total=120)) as session:
        yield session


async def metrics_text(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(f"{url}/metrics") as response:
        assert response.status == 200 and response.content_type == "text/plain"
        return await response.text()


def assert_timeline(timeline: dict[str, Any], prompt_tokens: int | None = None) -> None:
    assert timeline["ttft_ms"] > 0 and timeline["e2e_ms"] >= timeline["ttft_ms"]
    assert timeline["retrieval_ms"] > 0
    assert 0 <= timeline["non_overlapped_retrieval_ms"] <= timeline["retrieval_ms"]
    assert 0 <= timeline["cached_prompt_tokens"] <= timeline["prompt_tokens"]
    assert isinstance(timeline["speculations"], int) and isinstance(timeline["adopted"], bool)
    if prompt_tokens is not None:
        assert timeline["prompt_tokens"] == prompt_tokens


async def test_health_needs_no_token_and_reports_the_engine_ready(
    service: tuple[str, RagController], http: aiohttp.ClientSession
) -> None:
    url, _ = service
    async with aiohttp.ClientSession() as anonymous, anonymous.get(f"{url}/health") as response:
        assert response.status == 200
        assert await response.json() == {"status": "ok"}  # ready; the details are the operator's
    async with http.get(f"{url}/health") as response:
        assert response.status == 200
        body = await response.json()
    assert body["status"] == "ok" and body["in_flight_queries"] == 0


async def test_rag_answers_with_documents_and_the_timeline(
    service: tuple[str, RagController], http: aiohttp.ClientSession
) -> None:
    url, _ = service
    async with http.post(f"{url}/v1/rag", json={"query": QUESTION, "k": 4, "max_tokens": 4}) as response:
        assert response.status == 200
        body = await response.json()
    assert set(body) == {"answer", "finish_reason", "documents", "sources", "specrag"}
    assert isinstance(body["answer"], str) and len(body["documents"]) == 4
    assert body["documents"] == body["specrag"]["documents"]
    assert any("asyncio" in doc for doc in body["documents"])
    assert_timeline(body["specrag"])


async def test_a_streamed_rag_answer_is_deltas_then_done(
    service: tuple[str, RagController], http: aiohttp.ClientSession
) -> None:
    url, _ = service
    request = {"query": QUESTION, "k": 4, "max_tokens": 6, "stream": True}
    async with http.post(f"{url}/v1/rag", json=request) as response:
        assert response.status == 200 and response.content_type == "text/event-stream"
        events = sse_events(await response.text())
    kinds = [kind for kind, _ in events]
    assert kinds[-1] == "done" and set(kinds[:-1]) == {"delta"} and len(kinds) >= 2
    done = json.loads(events[-1][1])
    assert "".join(json.loads(data)["text"] for _, data in events[:-1]) == done["answer"]
    assert_timeline(done["specrag"])


async def test_chat_completions_answers_the_last_user_message(
    service: tuple[str, RagController], http: aiohttp.ClientSession
) -> None:
    url, controller = service
    earlier = "What does the assert statement do?"
    # Retrieval runs on the last user message, with the earlier ones as its conversation.
    followup = RagRequest(QUESTION, k=4, max_tokens=2, previous_questions=(earlier,))
    expected_documents = list((await controller.answer(followup)).timeline.documents)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": earlier},
        {"role": "assistant", "content": "It checks a condition."},
        {"role": "user", "content": [{"type": "text", "text": QUESTION}]},
    ]
    request = {"model": "anything", "messages": messages, "max_completion_tokens": 5, "k": 4}
    async with http.post(f"{url}/v1/chat/completions", json=request) as response:
        assert response.status == 200
        body = await response.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert body["model"] == "specrag"
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    assert choice["finish_reason"] in {"stop", "length"}
    usage, timeline = body["usage"], body["specrag"]
    assert 1 <= usage["completion_tokens"] <= 5
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == timeline["cached_prompt_tokens"]
    assert timeline["documents"] == expected_documents
    assert_timeline(timeline, prompt_tokens=usage["prompt_tokens"])


async def test_streamed_chat_completions_end_with_usage_timeline_and_done(
    service: tuple[str, RagController], http: aiohttp.ClientSession
) -> None:
    url, _ = service
    request = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 4, "stream": True, "k": 4}
    async with http.post(f"{url}/v1/chat/completions", json=request) as response:
        assert response.status == 200 and response.content_type == "text/event-stream"
        events = sse_events(await response.text())
    assert events[-1] == ("message", "[DONE]")
    chunks = [json.loads(data) for _, data in events[:-1]]
    assert {chunk["object"] for chunk in chunks} == {"chat.completion.chunk"}
    assert len({chunk["id"] for chunk in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    last = chunks[-1]
    assert last["choices"][0]["finish_reason"] in {"stop", "length"}
    assert all(chunk["choices"][0]["finish_reason"] is None for chunk in chunks[:-1])
    text = "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in chunks)
    assert isinstance(text, str) and last["usage"]["completion_tokens"] >= 1
    assert_timeline(last["specrag"], prompt_tokens=last["usage"]["prompt_tokens"])


async def test_sessions_are_created_used_and_closed(
    service: tuple[str, RagController], http: aiohttp.ClientSession
) -> None:
    url, controller = service
    async with http.post(f"{url}/v1/sessions") as response:
        assert response.status == 201
        session_id = (await response.json())["session_id"]
    turn = {"query": QUESTION, "k": 4, "max_tokens": 3, "session_id": session_id}
    async with http.post(f"{url}/v1/rag", json=turn) as response:
        assert response.status == 200
    assert controller.sessions.get(session_id, "127.0.0.1").turns == 1
    async with http.delete(f"{url}/v1/sessions/{session_id}") as response:
        assert response.status == 204
    async with http.delete(f"{url}/v1/sessions/{session_id}") as response:
        assert response.status == 404
        assert (await response.json())["error"]["type"] == "not_found_error"
    async with http.post(f"{url}/v1/rag", json=turn) as response:
        assert response.status == 404
        assert "unknown session" in (await response.json())["error"]["message"]


RAG = "/v1/rag"
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": QUESTION}]


@pytest.mark.parametrize(
    ("path", "body", "status", "message"),
    [
        (RAG, {"query": "   "}, 400, "question is empty"),
        (RAG, {}, 400, "'query' is required"),
        (RAG, {"query": 3}, 400, "'query' must be a string"),
        (RAG, {"query": "x" * 4001}, 400, "longer than 4000"),
        (RAG, {"query": QUESTION, "k": 0}, 400, "k must be an integer between 1 and 50"),
        (RAG, {"query": QUESTION, "k": 51}, 400, "k must be an integer between 1 and 50"),
        (RAG, {"query": QUESTION, "k": "4"}, 400, "'k' must be an integer, got str"),
        (RAG, {"query": QUESTION, "k": True}, 400, "'k' must be an integer, got bool"),
        (RAG, {"query": QUESTION, "k": 4.0}, 400, "'k' must be an integer, got float"),
        (RAG, {"query": QUESTION, "mode": "turbo"}, 400, "unknown mode 'turbo'"),
        (RAG, {"query": QUESTION, "max_tokens": 0}, 400, "max_tokens must be between"),
        (RAG, {"query": QUESTION, "stream": "yes"}, 400, "'stream' must be a boolean"),
        (RAG, {"query": QUESTION, "top_k": 3}, 400, "unknown fields: top_k"),
        (RAG, {"query": QUESTION, "k": 50, "mode": "serial"}, 400, "exceeds the model's limit"),
        (RAG, {"query": QUESTION, "session_id": "nope"}, 404, "unknown session 'nope'"),
        (RAG, [QUESTION], 400, "must be a JSON object"),
        (RAG, {"query": QUESTION, "repetition_penalty": 0}, 400, "repetition_penalty must be greater than 0"),
        (RAG, {"query": QUESTION, "presence_penalty": True}, 400, "'presence_penalty' must be a number"),
        (CHAT, {}, 400, "'messages' is required"),
        (CHAT, {"messages": []}, 400, "'messages' must not be empty"),
        (CHAT, {"messages": "hi"}, 400, "'messages' must be a list"),
        (CHAT, {"messages": [{"content": "hi"}]}, 400, "must be an object with a string 'role'"),
        (CHAT, {"messages": [{"role": "system", "content": "hi"}]}, 400, "has no user message"),
        (CHAT, {"messages": [{"role": "user", "content": 3}]}, 400, "must be a string or a list"),
        (CHAT, {"messages": USER, "model": 3}, 400, "'model' must be a string"),
        (CHAT, {"messages": USER, "max_completion_tokens": "9"}, 400, "must be an integer"),
        (
            CHAT,
            {"messages": USER, "frequency_penalty": 2.5},
            400,
            "frequency_penalty must be between -2 and 2",
        ),
        (
            CHAT,
            {"messages": USER, "presence_penalty": -2.01},
            400,
            "presence_penalty must be between -2 and 2",
        ),
        (CHAT, {"messages": USER, "repetition_penalty": "1.2"}, 400, "'repetition_penalty' must be a number"),
    ],
)
async def test_bad_input_gets_a_4xx_with_a_json_error(
    service: tuple[str, RagController],
    http: aiohttp.ClientSession,
    vllm_engine: VllmEngine,
    path: str,
    body: Any,
    status: int,
    message: str,
) -> None:
    url, controller = service
    async with http.post(url + path, json=body) as response:
        assert response.status == status
        error = (await response.json())["error"]
    assert message in error["message"] and error["type"] and error["code"]
    await assert_engine_idle(vllm_engine, controller)


OVER_LONG = [(RAG, {"query": QUESTION, "k": 50, "stream": True}), (CHAT, {"messages": USER, "k": 50})]


@pytest.mark.parametrize(("path", "body"), OVER_LONG)
async def test_an_over_long_prompt_is_a_400_even_when_streamed(
    vllm_engine: VllmEngine, tiny_assets: Assets, path: str, body: dict[str, Any]
) -> None:
    # A controller of its own, so the rejected query's bookkeeping is checked in isolation.
    async with (
        running(make_controller(vllm_engine, tiny_assets)) as url,
        aiohttp.ClientSession() as http,
        http.post(url + path, json=body) as response,
    ):
        assert response.status == 400 and response.content_type == "application/json"
        assert "exceeds the model's limit" in (await response.json())["error"]["message"]


@pytest.mark.parametrize(("path", "body"), OVER_LONG)
async def test_an_over_long_prompt_leaves_the_prefill_pool_empty(
    vllm_engine: VllmEngine, tiny_assets: Assets, path: str, body: dict[str, Any]
) -> None:
    controller = make_controller(vllm_engine, tiny_assets)
    async with running(controller) as url, aiohttp.ClientSession() as http:
        async with http.post(url + path, json=body) as response:
            assert response.status == 400
        # The system-prompt warm-up the query started may finish after it; nothing else holds a slot.
        for _ in range(100):
            if controller.gate.pool == 0:
                break
            await asyncio.sleep(0.05)
        assert controller.gate.pool == 0


@pytest.mark.parametrize(
    ("data", "headers", "status", "message"),
    [
        (b'{"query": ', {"Content-Type": "application/json"}, 400, "not valid JSON"),
        (b"\xff\xfe", {"Content-Type": "application/json"}, 400, "not valid JSON"),
        (b"query=hello", {"Content-Type": "application/x-www-form-urlencoded"}, 415, "Content-Type"),
        (
            json.dumps({"query": "x" * MAX_BODY}).encode(),
            {"Content-Type": "application/json"},
            413,
            "Maximum request body size",
        ),
    ],
)
async def test_malformed_or_oversized_bodies_are_rejected(
    service: tuple[str, RagController],
    http: aiohttp.ClientSession,
    data: bytes,
    headers: dict[str, str],
    status: int,
    message: str,
) -> None:
    url, _ = service
    async with http.post(f"{url}/v1/rag", data=data, headers=headers) as response:
        assert response.status == status
        assert message in (await response.json())["error"]["message"]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}])
@pytest.mark.parametrize(
    ("method", "path"), [("POST", "/v1/rag"), ("GET", "/metrics"), ("POST", "/v1/sessions")]
)
async def test_a_missing_or_wrong_token_gets_401(
    service: tuple[str, RagController], headers: dict[str, str], method: str, path: str
) -> None:
    url, _ = service
    async with (
        aiohttp.ClientSession() as anonymous,
        anonymous.request(method, url + path, json={"query": QUESTION}, headers=headers) as response,
    ):
        assert response.status == 401 and response.headers["WWW-Authenticate"] == "Bearer"
        assert (await response.json())["error"]["type"] == "authentication_error"


async def test_unknown_routes_and_methods_get_json_errors(
    service: tuple[str, RagController], http: aiohttp.ClientSession
) -> None:
    url, _ = service
    async with http.get(f"{url}/v1/nothing") as response:
        assert response.status == 404 and (await response.json())["error"]["code"] == "not_found"
    async with http.get(f"{url}/v1/rag") as response:
        assert response.status == 405 and "error" in await response.json()


async def test_an_unexpected_failure_is_a_generic_500(
    vllm_engine: VllmEngine, tiny_assets: Assets, monkeypatch: pytest.MonkeyPatch
) -> None:
    index = scripted_index(tiny_assets, [A])

    def explode(text: str) -> Any:
        raise RuntimeError("secret internal detail")

    monkeypatch.setattr(index, "embed_query", explode)
    async with (
        running(make_controller(vllm_engine, tiny_assets, index)) as url,
        aiohttp.ClientSession() as http,
        http.post(f"{url}/v1/rag", json={"query": QUESTION}) as response,
    ):
        assert response.status == 500
        text = await response.text()
    assert json.loads(text)["error"]["message"] == "internal server error"
    assert "secret" not in text and "Traceback" not in text


async def test_metrics_count_requests_tokens_and_latencies(
    service: tuple[str, RagController], http: aiohttp.ClientSession
) -> None:
    url, _ = service
    before = await metrics_text(http, url)
    async with http.post(f"{url}/v1/rag", json={"query": QUESTION, "k": 4, "max_tokens": 2}) as response:
        prompt_tokens = (await response.json())["specrag"]["prompt_tokens"]
    async with http.post(f"{url}/v1/rag", json={"query": QUESTION, "mode": "turbo"}) as response:
        assert response.status == 400
    after = await metrics_text(http, url)

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert delta("specrag_requests_total", mode="all", outcome="ok") == 1
    assert delta("specrag_requests_total", mode="invalid", outcome="rejected") == 1
    assert delta("specrag_prompt_tokens_total") == prompt_tokens
    for histogram in ("ttft", "e2e", "retrieval", "non_overlapped_retrieval", "queue_wait"):
        assert delta(f"specrag_{histogram}_seconds_count") == 1
    assert metric(after, "specrag_in_flight_queries") == 0 and metric(after, "specrag_prefill_pool") == 0


async def test_a_client_leaving_mid_stream_aborts_the_query(
    service: tuple[str, RagController], http: aiohttp.ClientSession, vllm_engine: VllmEngine
) -> None:
    url, controller = service
    before = await metrics_text(http, url)
    request = {"query": QUESTION, "k": 4, "max_tokens": 1000, "stream": True}
    async with http.post(f"{url}/v1/rag", json=request) as response:
        assert (await response.content.readline()).startswith(b"event: delta")
        assert controller.in_flight_request_ids()
        response.close()  # drop the connection mid-answer
    await assert_engine_idle(vllm_engine, controller)
    after = await metrics_text(http, url)
    labels = {"mode": "all", "outcome": "disconnected"}
    assert (
        metric(after, "specrag_requests_total", **labels)
        == metric(before, "specrag_requests_total", **labels) + 1
    )


async def test_a_client_leaving_before_a_whole_answer_aborts_the_query(
    vllm_engine: VllmEngine, tiny_assets: Assets
) -> None:
    # Slow staged search: the client leaves mid-search with a speculation in flight.
    controller = make_controller(vllm_engine, tiny_assets, scripted_index(tiny_assets, [A, B, A, B, A]))
    async with running(controller) as url, aiohttp.ClientSession() as http:
        request = {"query": QUESTION, "k": 4, "max_tokens": 1000}
        call = asyncio.create_task(http.post(f"{url}/v1/rag", json=request))
        for _ in range(200):
            if controller.in_flight_request_ids():
                break
            await asyncio.sleep(0.02)
        assert controller.in_flight_request_ids(), "no engine request was submitted"
        call.cancel()  # the client gives up: aiohttp closes the connection
        with pytest.raises(asyncio.CancelledError):
            await call
        await assert_engine_idle(vllm_engine, controller)
        text = await metrics_text(http, url)
    assert metric(text, "specrag_requests_total", mode="all", outcome="disconnected") == 1
    assert metric(text, "specrag_requests_total", mode="all", outcome="ok") == 0


async def test_queries_beyond_the_limit_get_429_with_retry_after(
    vllm_engine: VllmEngine, tiny_assets: Assets
) -> None:
    controller = make_controller(vllm_engine, tiny_assets)
    async with running(controller, Access(max_queries=1)) as url, aiohttp.ClientSession() as http:
        request = {"query": QUESTION, "k": 4, "max_tokens": 1000, "stream": True}
        async with http.post(f"{url}/v1/rag", json=request) as held:
            await held.content.readline()  # the first query is mid-answer
            async with http.post(f"{url}/v1/rag", json={"query": QUESTION}) as response:
                assert response.status == 429 and int(response.headers["Retry-After"]) >= 1
                assert (await response.json())["error"]["code"] == "overloaded"
            # Bad input is still told what is wrong with it, not to come back later.
            async with http.post(f"{url}/v1/rag", json={"query": "  ", "k": 4}) as response:
                assert response.status == 400, await response.text()
            held.close()
        await assert_engine_idle(vllm_engine, controller)
