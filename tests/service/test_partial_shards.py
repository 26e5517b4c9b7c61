"""``allow_partial`` over HTTP: a boolean or a 400 naming it; on a sharded index whose shard fails,
the merged top-k of the others and a timeline naming both, and 503 naming the shard without it."""

from __future__ import annotations

from typing import Any

import aiohttp
import numpy as np
import pytest

from specrag.retrieval.backends.shards.build import build_ivf_shards
from specrag.retrieval.backends.shards.merge import ShardedSearcher
from specrag.retrieval.vector_index import VectorIndex
from specrag.service.http.app import create_app, serving
from specrag.service.http.monitoring import SEARCH_SHARDS
from specrag.service.run.assets import Assets
from specrag.sim.engine import SimulatedEngine
from tests.helpers.builders import QUESTION, make_controller
from tests.helpers.http import running
from tests.helpers.shards import SilentShard

RAG = "/v1/rag"
BATCH = "/v1/rag/batch"
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": QUESTION}]


def sharded_with_a_silent_shard(index: VectorIndex) -> VectorIndex:
    """``index``'s rows as two IVF shards, shard 001 never answering; dense only, so that every
    row served is one a shard found (BM25 stays whole beside the merge)."""
    _, vectors = index.searcher.stored_vectors(np.ones(index.searcher.ntotal, dtype=bool))  # type: ignore[attr-defined]
    built = build_ivf_shards(vectors, 2, nlist=4, nprobe=4)
    searcher = ShardedSearcher([built.shards[0], SilentShard(built.shards[1])], None, built.keep_max)
    return VectorIndex(
        searcher,
        index.passage_ids,
        index.synthetic_sources,
        index.embedder,
        lexical=None,
        fusion=index.fusion,
    )


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (RAG, {"query": QUESTION, "allow_partial": "yes"}),
        (RAG, {"query": QUESTION, "allow_partial": 1}),
        (CHAT, {"messages": USER, "allow_partial": 0}),
        (BATCH, {"queries": [QUESTION], "allow_partial": "true"}),
    ],
)
async def test_allow_partial_must_be_a_boolean(tiny_assets: Assets, path: str, body: dict[str, Any]) -> None:
    engine = SimulatedEngine(time_scale=0.01, max_model_len=4096)
    async with (
        running(make_controller(engine, tiny_assets)) as url,
        aiohttp.ClientSession() as http,
        http.post(url + path, json=body) as response,
    ):
        assert response.status == 400
        assert "'allow_partial' must be a boolean" in (await response.json())["error"]["message"]


async def test_a_silent_shard_fails_the_query_unless_partial_is_allowed(tiny_assets: Assets) -> None:
    engine = SimulatedEngine(time_scale=0.01, max_model_len=4096)
    index = sharded_with_a_silent_shard(tiny_assets.index)
    body = {"query": QUESTION, "k": 3, "mode": "serial", "max_tokens": 2}
    chat = {"messages": USER, "k": 3, "max_tokens": 2, "allow_partial": True}
    async with (
        running(make_controller(engine, tiny_assets, index)) as url,
        aiohttp.ClientSession() as http,
    ):
        async with http.post(url + RAG, json=body) as response:
            assert response.status == 503
            assert "search shard 001" in (await response.json())["error"]["message"]
        async with http.post(url + RAG, json={**body, "allow_partial": True}) as response:
            assert response.status == 200, await response.text()
            answer = await response.json()
        async with http.post(url + CHAT, json=chat) as response:
            assert response.status == 200, await response.text()
    shards = [event for event in answer["specrag"]["events"] if event["kind"] == "shards"]
    assert len(shards) == 1
    assert shards[0]["answered"] == ["000"]
    assert list(shards[0]["missing"]) == ["001"] and "did not answer" in shards[0]["missing"]["001"]
    rows = {tiny_assets.index.passage_ids.index(passage) for passage in answer["documents"]}
    assert all(row % 2 == 0 for row in rows), "only shard 000's rows (even rows) are served"


async def test_a_batch_over_a_silent_shard_fails_unless_partial_is_allowed(tiny_assets: Assets) -> None:
    engine = SimulatedEngine(time_scale=0.01, max_model_len=4096)
    index = sharded_with_a_silent_shard(tiny_assets.index)
    body = {"queries": [QUESTION, "how are lists sorted"], "k": 3, "mode": "serial", "max_tokens": 2}
    async with (
        running(make_controller(engine, tiny_assets, index)) as url,
        aiohttp.ClientSession() as http,
    ):
        async with http.post(url + BATCH, json=body) as response:
            assert response.status == 503
            assert "search shard 001" in (await response.json())["error"]["message"]
        async with http.post(url + BATCH, json={**body, "allow_partial": True}) as response:
            assert response.status == 200, await response.text()
            answers = (await response.json())["answers"]
    assert len(answers) == 2
    for answer in answers:
        (shards,) = [event for event in answer["specrag"]["events"] if event["kind"] == "shards"]
        assert shards["answered"] == ["000"] and list(shards["missing"]) == ["001"]
        rows = {tiny_assets.index.passage_ids.index(passage) for passage in answer["documents"]}
        assert all(row % 2 == 0 for row in rows), "only shard 000's rows (even rows) are served"


async def test_health_names_every_search_shard_and_fails_while_one_has_failed(tiny_assets: Assets) -> None:
    engine = SimulatedEngine(time_scale=0.01, max_model_len=4096)
    controller = make_controller(engine, tiny_assets)
    shards: list[dict[str, Any]] = [
        {"name": "000", "state": "serving", "reason": None},
        {"name": "001", "state": "replacing", "reason": "its actor died"},
    ]
    app = create_app(controller)
    app[SEARCH_SHARDS] = shards.copy
    try:
        async with serving(app, access_log=False) as url, aiohttp.ClientSession() as http:
            async with http.get(f"{url}/health") as response:
                assert response.status == 200
                assert (await response.json())["search_shards"] == shards
            shards[1] = {"name": "001", "state": "lost", "reason": "its new actor did not start"}
            async with http.get(f"{url}/health") as response:
                assert response.status == 503
                body = await response.json()
    finally:
        await controller.close()
        await engine.close()
    assert body["reason"] == "search shard(s) 001 failed" and body["search_shards"] == shards
