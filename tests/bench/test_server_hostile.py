"""The service against hostile or careless clients, on the simulated engine over real
loopback sockets: every catalogue request gets its 4xx and nothing is logged at ERROR, sessions
survive other clients and refuse concurrent turns, OpenAI's sampling fields and model list work,
half-sent requests end at the read timeouts, and the warm-up counter is the controller's own."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import aiohttp
import pytest
import pytest_asyncio

from bench.faults.inputs import BAD_REQUESTS, BadRequest, send, send_wire
from specrag.controller.controller import RagController
from specrag.pipeline.engines.protocol import EngineOutput, Sampling
from specrag.service.http.access import Access
from specrag.service.http.app import create_app, serving
from specrag.service.run.assets import Assets
from specrag.sim.engine import SimulatedEngine
from tests.helpers.builders import QUESTION, A, make_controller, scripted_index
from tests.helpers.engines import HeldWarmEngine
from tests.helpers.http import metric, sse_events
from tests.helpers.waiting import assert_engine_idle

TOKEN = "hostile-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
READ_TIMEOUT_S = 1.0
USER = [{"role": "user", "content": QUESTION}]


class SamplingRecorder(SimulatedEngine):
    """The simulated engine, remembering the sampling settings of every request."""

    def __init__(self) -> None:
        super().__init__(time_scale=0.01, max_model_len=4096)
        self.samplings: list[Sampling] = []

    def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], sampling: Sampling
    ) -> AsyncIterator[EngineOutput]:
        self.samplings.append(sampling)
        return super().generate(request_id, prompt_token_ids, sampling)


@dataclass
class Service:
    url: str
    controller: RagController
    engine: SamplingRecorder


@pytest_asyncio.fixture(loop_scope="session")
async def service(tiny_assets: Assets) -> AsyncIterator[Service]:
    engine = SamplingRecorder()
    controller = make_controller(engine, tiny_assets)  # the real index: k = 50 retrieves 50 passages
    app = create_app(
        controller, Access(tokens=(TOKEN,)), header_timeout_s=READ_TIMEOUT_S, body_timeout_s=READ_TIMEOUT_S
    )
    try:
        async with serving(app, access_log=False) as url:
            yield Service(url, controller, engine)
    finally:
        await controller.close()
        await engine.close()


def http(local_address: str | None = None) -> aiohttp.ClientSession:
    """A client on fresh connections: the service closes idle ones after the (short) header timeout."""
    source = (local_address, 0) if local_address else None
    connector = aiohttp.TCPConnector(local_addr=source, force_close=True)
    return aiohttp.ClientSession(connector=connector, headers=AUTH, timeout=aiohttp.ClientTimeout(total=30))


async def test_every_catalogue_request_gets_its_4xx_and_nothing_is_logged_as_an_error(
    service: Service, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    wrong: list[tuple[BadRequest, int, str]] = []
    for row in BAD_REQUESTS:
        async with aiohttp.ClientSession() as plain:  # the rows choose their own Authorization
            status, message = await send(plain, service.url, row, TOKEN)
        if status != row.status or row.message not in message:
            wrong.append((row, status, message))
    assert wrong == []
    assert [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR] == []
    await assert_engine_idle(service.engine, service.controller)


async def test_a_half_sent_request_ends_at_the_read_timeout(service: Service) -> None:
    for name, status in (("half-sent headers", 0), ("body short of its Content-Length", 408)):
        row = next(row for row in BAD_REQUESTS if row.name == name)
        assert row.wire is not None
        started = time.perf_counter()
        answer = await send_wire(service.url, row.wire.replace(b"{token}", TOKEN.encode()), within_s=10)
        assert answer[0] == status and READ_TIMEOUT_S * 0.9 <= time.perf_counter() - started < 5


async def test_a_body_announced_past_the_limit_is_refused_at_once(service: Service) -> None:
    row = next(row for row in BAD_REQUESTS if row.name == "10 GB announced, 1 byte sent")
    assert row.wire is not None
    started = time.perf_counter()
    status, message = await send_wire(service.url, row.wire.replace(b"{token}", TOKEN.encode()), within_s=10)
    assert (status, "Content-Length is 10000000000" in message) == (413, True)
    assert time.perf_counter() - started < READ_TIMEOUT_S / 2  # not after the body timeout's 408


async def test_malformed_http_is_logged_as_one_info_line(
    service: Service, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    row = next(row for row in BAD_REQUESTS if row.name == "bad chunk size")
    assert row.wire is not None
    assert (await send_wire(service.url, row.wire))[0] == 400
    lines = [(r.levelno, r.getMessage(), r.exc_info) for r in caplog.records if "malformed" in r.getMessage()]
    assert lines == [
        (logging.INFO, "malformed HTTP request from 127.0.0.1: Invalid character in chunk size", None)
    ]


async def test_one_client_cannot_evict_another_clients_session(service: Service) -> None:
    async with http("127.0.0.2") as other, other.post(f"{service.url}/v1/sessions") as response:
        assert response.status == 201
        kept = (await response.json())["session_id"]
    async with http() as flood:
        for _ in range(1000):  # the store holds 1,000 sessions: without a per-client bound, all this one's
            async with flood.post(f"{service.url}/v1/sessions") as response:
                assert response.status == 201
    store = service.controller.sessions
    assert store.owned_by("127.0.0.1") == service.controller.config.max_sessions_per_client
    async with http("127.0.0.2") as other:
        body = {"query": QUESTION, "k": 4, "max_tokens": 2, "session_id": kept}
        async with other.post(f"{service.url}/v1/rag", json=body) as response:
            assert response.status == 200


async def test_a_second_turn_while_one_streams_is_a_409(service: Service) -> None:
    async with http() as client:
        async with client.post(f"{service.url}/v1/sessions") as response:
            session_id = (await response.json())["session_id"]
        first = {"query": QUESTION, "k": 4, "max_tokens": 300, "session_id": session_id, "stream": True}
        async with client.post(f"{service.url}/v1/rag", json=first) as streaming:
            assert streaming.status == 200
            await streaming.content.readuntil(b"\n\n")  # the first delta: the turn runs
            second = {"query": QUESTION, "k": 4, "max_tokens": 2, "session_id": session_id}
            async with client.post(f"{service.url}/v1/rag", json=second) as response:
                assert response.status == 409
                error = (await response.json())["error"]
            assert error["type"] == "conflict_error" and "has a turn in progress" in error["message"]
        await assert_engine_idle(service.engine, service.controller)  # the streamed turn was abandoned
        async with client.post(f"{service.url}/v1/rag", json=second) as response:
            assert response.status == 200
    assert service.controller.sessions.get(session_id, "127.0.0.1").turns == 1


async def chat(client: aiohttp.ClientSession, url: str, **fields: object) -> dict[str, object]:
    body = {"messages": USER, "k": 4, **fields}
    async with client.post(f"{url}/v1/chat/completions", json=body) as response:
        assert response.status == 200, await response.text()
        answer: dict[str, object] = await response.json()
        return answer


async def test_chat_sampling_fields_reach_the_engine_and_stop_ends_the_answer(service: Service) -> None:
    async with http() as client:
        fields: dict[str, object] = {"max_completion_tokens": 12, "temperature": 0.5, "top_p": 0.9, "seed": 7}
        whole = await chat(client, service.url, **fields)
        text = whole["choices"][0]["message"]["content"]  # type: ignore[index]
        fields["stop"] = stop = text.split()[4]
        stopped = await chat(client, service.url, **fields, n=1, logprobs=False, presence_penalty=0)
        choice = stopped["choices"][0]  # type: ignore[index]
        assert choice["message"]["content"] == text[: text.index(stop)] and choice["finish_reason"] == "stop"
        assert service.engine.samplings[-1] == Sampling(
            max_tokens=12, temperature=0.5, top_p=0.9, seed=7, stop=(stop,)
        )
        async with client.post(
            f"{service.url}/v1/chat/completions", json={"messages": USER, "k": 4, "stream": True, **fields}
        ) as response:
            chunks = [json.loads(data) for _, data in sse_events(await response.text()) if data != "[DONE]"]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == text[: text.index(stop)]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_optional_chat_fields_sent_as_null_are_absent(service: Service) -> None:
    nulls = dict.fromkeys(("audio", "response_format", "tools", "tool_choice", "n", "logprobs", "stop"))
    async with http() as client:
        answer = await chat(client, service.url, max_completion_tokens=3, max_tokens=None, **nulls)
    assert answer["usage"]["completion_tokens"] == 3  # type: ignore[index]


async def test_include_usage_ends_the_stream_with_openais_usage_chunk(service: Service) -> None:
    body = {"messages": USER, "k": 4, "max_tokens": 3, "stream": True}
    async with http() as client:
        for options, usage_alone in (({"include_usage": True}, True), ({}, False)):
            async with client.post(
                f"{service.url}/v1/chat/completions", json={**body, "stream_options": options}
            ) as response:
                events = sse_events(await response.text())
            assert events[-1] == ("message", "[DONE]")
            *chunks, last = [json.loads(data) for _, data in events[:-1]]
            if usage_alone:  # OpenAI's shape: the finish reason, then a chunk of usage alone
                assert last["choices"] == [] and chunks[-1]["choices"][0]["finish_reason"] == "length"
            else:
                assert last["choices"][0]["finish_reason"] == "length"
            assert last["usage"]["completion_tokens"] == 3 and "specrag" in last
            assert all("usage" not in chunk for chunk in chunks)


async def test_the_model_list_names_the_served_model(service: Service) -> None:
    async with http() as client:
        async with client.get(f"{service.url}/v1/models") as response:
            assert response.status == 200
            models = await response.json()
        assert models["object"] == "list" and [m["id"] for m in models["data"]] == ["specrag"]
        async with client.get(f"{service.url}/v1/models/specrag") as response:
            assert (await response.json())["owned_by"] == "specrag"


async def test_the_warm_up_counter_is_the_controllers_record(tiny_assets: Assets) -> None:
    """A warm-up outlives the query that started it: counted when it ends, not from the timeline."""
    engine = HeldWarmEngine()
    index = scripted_index(tiny_assets, [A, A], 0.01)
    # Unpriced: the warm-up starts whatever it would save (its pricing: test_speculation_policy).
    controller = make_controller(engine, tiny_assets, index, max_prefill_bs=2, speculation="always")
    try:
        async with (
            serving(create_app(controller), access_log=False) as url,
            aiohttp.ClientSession() as client,
        ):
            body = {"query": QUESTION, "k": 4, "mode": "warmup", "max_tokens": 2}
            async with client.post(f"{url}/v1/rag", json=body) as response:
                assert response.status == 200
            async with client.get(f"{url}/metrics") as response:
                before = await response.text()
            engine.release_warm.set()
            await asyncio.wait_for(engine.warm_returned.wait(), 5)
            async with client.get(f"{url}/metrics") as response:
                after = await response.text()
    finally:
        await controller.close()
        await engine.close()
    assert metric(before, "specrag_warmups_total", outcome="started") == 1
    assert metric(before, "specrag_warmups_total", outcome="succeeded") == 0
    assert metric(after, "specrag_warmups_total", outcome="succeeded") == 1


TOKENS = ("token-of-alice", "token-of-bob", "token-of-carol")


def as_client(token: str, **headers: str) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        headers={"Authorization": f"Bearer {token}", **headers}, timeout=aiohttp.ClientTimeout(total=30)
    )


async def test_clients_are_told_apart_by_token_and_a_flood_evicts_only_its_own(tiny_assets: Assets) -> None:
    """Three tokens from one address: Bob's flood replaces Bob's sessions only, and past the
    global bound Carol gets a 429 with Retry-After rather than Alice losing her conversation."""
    engine = SimulatedEngine(time_scale=0.01, max_model_len=4096)
    controller = make_controller(engine, tiny_assets, max_sessions=4, max_sessions_per_client=3)
    try:
        async with serving(create_app(controller, Access(tokens=TOKENS)), access_log=False) as url:
            async with as_client(TOKENS[0]) as alice, alice.post(f"{url}/v1/sessions") as response:
                assert response.status == 201
                kept = (await response.json())["session_id"]
            async with as_client(TOKENS[1]) as bob:
                for _ in range(200):
                    async with bob.post(f"{url}/v1/sessions") as response:
                        assert response.status == 201
            store = controller.sessions
            assert (store.owned_by("token 1"), store.owned_by("token 2"), len(store)) == (1, 3, 4)
            async with as_client(TOKENS[2]) as carol, carol.post(f"{url}/v1/sessions") as response:
                assert response.status == 429 and int(response.headers["Retry-After"]) > 3000
                assert "4 sessions are open" in (await response.json())["error"]["message"]
            async with as_client(TOKENS[0]) as alice:
                body = {"query": QUESTION, "k": 4, "max_tokens": 2, "session_id": kept}
                async with alice.post(f"{url}/v1/rag", json=body) as response:
                    assert response.status == 200
            async with aiohttp.ClientSession() as anonymous, anonymous.post(f"{url}/v1/sessions") as response:
                assert response.status == 401
    finally:
        await controller.close()
        await engine.close()


@pytest.mark.parametrize("trusted", [True, False])
async def test_a_trusted_proxys_forwarded_address_tells_clients_apart(
    tiny_assets: Assets, trusted: bool
) -> None:
    engine = SimulatedEngine(time_scale=0.01, max_model_len=4096)
    controller = make_controller(engine, tiny_assets)
    try:
        app = create_app(controller, Access(trust_forwarded_for=trusted))
        async with serving(app, access_log=False) as url:
            for forwarded in ("203.0.113.9, 10.0.0.1", "10.0.0.2", "10.0.0.2"):
                async with (
                    aiohttp.ClientSession(headers={"X-Forwarded-For": forwarded}) as client,
                    client.post(f"{url}/v1/sessions") as response,
                ):
                    assert response.status == 201
    finally:
        await controller.close()
        await engine.close()
    owners = [controller.sessions.owned_by(owner) for owner in ("10.0.0.1", "10.0.0.2", "127.0.0.1")]
    assert owners == ([1, 2, 0] if trusted else [0, 0, 3])
