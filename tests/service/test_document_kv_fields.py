"""``document_kv_fresh`` over HTTP: an integer from 0 to the request's k, else a 400 naming it."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from specrag.service.run.assets import Assets
from specrag.sim.engine import SimulatedEngine
from tests.helpers.builders import QUESTION, make_controller
from tests.helpers.http import running

RAG = "/v1/rag"
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": QUESTION}]
BETWEEN = "document_kv_fresh must be an integer between 0 and 3"


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        (RAG, {"query": QUESTION, "k": 3, "document_kv_fresh": 4}, BETWEEN),
        (RAG, {"query": QUESTION, "k": 3, "document_kv_fresh": -1}, BETWEEN),
        (
            RAG,
            {"query": QUESTION, "k": 3, "document_kv_fresh": "1"},
            "'document_kv_fresh' must be an integer",
        ),
        (
            RAG,
            {"query": QUESTION, "k": 3, "document_kv_fresh": True},
            "'document_kv_fresh' must be an integer",
        ),
        (
            RAG,
            {"query": QUESTION, "k": 3, "document_kv_fresh": 1.5},
            "'document_kv_fresh' must be an integer",
        ),
        (CHAT, {"messages": USER, "k": 3, "document_kv_fresh": 9}, BETWEEN),
    ],
)
async def test_bad_fresh_counts_get_a_400(
    tiny_assets: Assets, path: str, body: dict[str, Any], message: str
) -> None:
    engine = SimulatedEngine(time_scale=0.01, max_model_len=4096, document_kv=True)
    async with (
        running(make_controller(engine, tiny_assets, document_kv="turbo")) as url,
        aiohttp.ClientSession() as http,
        http.post(url + path, json=body) as response,
    ):
        assert response.status == 400
        assert message in (await response.json())["error"]["message"]


async def test_a_fresh_count_within_k_is_served(tiny_assets: Assets) -> None:
    engine = SimulatedEngine(time_scale=0.01, max_model_len=4096, document_kv=True)
    body = {"query": QUESTION, "k": 3, "mode": "serial", "max_tokens": 2, "document_kv_fresh": 3}
    async with (
        running(make_controller(engine, tiny_assets, document_kv="turbo")) as url,
        aiohttp.ClientSession() as http,
        http.post(url + RAG, json=body) as response,
    ):
        assert response.status == 200, await response.text()
