"""Sessions belong to the client that made it, and their ids never reach the logs (simulated engine)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import pytest
import pytest_asyncio

from specrag.controller.controller import RagController
from specrag.controller.sessions import SessionStore
from specrag.errors import NotFoundError
from specrag.service.http.access import Access
from specrag.service.http.app import create_app, serving
from specrag.service.run.assets import Assets
from specrag.sim.engine import SimulatedEngine
from tests.helpers.builders import QUESTION, A, make_controller, scripted_index

TOKENS = ("token-of-a", "token-of-b")
AS_A = {"Authorization": f"Bearer {TOKENS[0]}"}
AS_B = {"Authorization": f"Bearer {TOKENS[1]}"}


@dataclass
class Service:
    url: str
    controller: RagController


@pytest_asyncio.fixture(loop_scope="session")
async def service(tiny_assets: Assets) -> AsyncIterator[Service]:
    engine = SimulatedEngine(time_scale=0.01, max_model_len=4096)
    controller = make_controller(engine, tiny_assets, scripted_index(tiny_assets, [A, A], 0.01))
    try:
        async with serving(create_app(controller, Access(tokens=TOKENS))) as url:
            yield Service(url, controller)
    finally:
        await controller.close()
        await engine.close()


def session_calls(session_id: str) -> list[tuple[str, str, dict[str, object] | None]]:
    """Every endpoint that takes a session id: (method, path, JSON body)."""
    turn = {"query": QUESTION, "k": 4, "max_tokens": 2, "session_id": session_id}
    chat = {
        "messages": [{"role": "user", "content": QUESTION}],
        "max_tokens": 2,
        "k": 4,
        "session_id": session_id,
    }
    return [
        ("POST", "/v1/rag", turn),
        ("POST", "/v1/rag", {**turn, "stream": True}),
        ("POST", "/v1/chat/completions", chat),
        ("POST", "/v1/chat/completions", {**chat, "stream": True}),
        ("DELETE", f"/v1/sessions/{session_id}", None),
    ]


async def test_another_client_gets_404_for_a_session_on_every_endpoint(service: Service) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{service.url}/v1/sessions", headers=AS_A) as response:
            assert response.status == 201
            session_id = (await response.json())["session_id"]
        for method, path, body in session_calls(session_id):
            async with http.request(method, service.url + path, json=body, headers=AS_B) as response:
                assert response.status == 404, (method, path, body)
                error = (await response.json())["error"]
            # The same answer as for an id that never existed: B learns nothing of A's ids.
            assert error["type"] == "not_found_error" and "unknown session" in error["message"]
        owner = service.controller.sessions.get(session_id, "token 1")
        assert owner.turns == 0  # nothing of B's reached A's conversation
        for method, path, body in session_calls(session_id):  # A may do all of it
            async with http.request(method, service.url + path, json=body, headers=AS_A) as response:
                assert response.status in (200, 204), (method, path, await response.text())
                await response.read()
        assert len(service.controller.sessions) == 0


async def test_session_ids_never_reach_the_access_log(
    service: Service, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with aiohttp.ClientSession(headers=AS_A) as http:
        async with http.post(f"{service.url}/v1/sessions") as response:
            session_id = (await response.json())["session_id"]
        async with http.delete(f"{service.url}/v1/sessions/{session_id}") as response:
            assert response.status == 204
        async with http.delete(f"{service.url}/v1/sessions/{session_id}?x=1") as response:
            assert response.status == 404
    access = [record for record in caplog.records if record.name == "aiohttp.access"]
    assert any("DELETE /v1/sessions/<session>" in record.getMessage() for record in access)
    for record in caplog.records:
        assert session_id not in record.getMessage()
        assert not any(isinstance(value, str) and session_id in value for value in vars(record).values())


def test_the_store_answers_another_client_as_if_the_session_did_not_exist() -> None:
    store = SessionStore()
    session = store.create("a")
    for call in (store.get, store.close):
        with pytest.raises(NotFoundError, match="unknown session") as other:
            call(session.session_id, "b")
        with pytest.raises(NotFoundError) as unknown:
            call("0123456789abcdef", "b")
        assert str(other.value).replace(session.session_id, "ID") == str(unknown.value).replace(
            "0123456789abcdef", "ID"
        )
    assert store.get(session.session_id, "a") is session
    store.close(session.session_id, "a")
    assert len(store) == 0
