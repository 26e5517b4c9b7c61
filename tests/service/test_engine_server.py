"""specrag against a separate vLLM server started as ``specrag engine`` starts it, with KV events:
cached tokens over HTTP, the knowledge tree following the remote cache, and recovery when the
server is killed and started again on the same ports."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specrag.controller.controller import RagRequest
from specrag.pipeline.engines.http_engine import HttpTimeouts
from specrag.pipeline.models.directory import served_model_name
from specrag.pipeline.models.random_model import RANDOM_MODEL_NAME
from specrag.service.http.app import serving
from specrag.service.run.assembly import ServiceOptions, open_service
from specrag.service.run.assets import Assets
from specrag.service.run.pools import free_port_pair
from tests.helpers.builders import QUESTION, A, scripted_index
from tests.helpers.http import EngineServer
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.engine


def serial(question: str) -> RagRequest:
    return RagRequest(question, k=4, mode="serial", max_tokens=4)


async def counter_total(url: str, family: str) -> float:
    """A Prometheus counter's total at ``url``'s /metrics, all series summed (vLLM's
    ``vllm:prefix_cache_hits``: prompt tokens served from its prefix cache, all requests so far)."""
    async with aiohttp.ClientSession() as http, http.get(url + "/metrics") as response:
        text = await response.text()
    return sum(
        sample.value
        for metrics in text_string_to_metric_families(text)
        if metrics.name == family
        for sample in metrics.samples
        if sample.name.endswith("_total")
    )


async def rag_status(http: aiohttp.ClientSession, url: str) -> int:
    body = {"query": QUESTION, "k": 4, "mode": "serial", "max_tokens": 4}
    async with http.post(url + "/v1/rag", json=body) as response:
        await response.read()
        return response.status


async def test_cached_tokens_mirror_and_recovery_against_a_separate_server(
    tiny_assets: Assets, tmp_path: Path
) -> None:
    kv_port = free_port_pair()
    server = EngineServer(tiny_assets.model_dir, tmp_path / "server.log", kv_events_port=kv_port)
    await asyncio.to_thread(server.start)
    # Scripted documents: two questions over the same documents share the system and document blocks.
    assets = dataclasses.replace(tiny_assets, index=scripted_index(tiny_assets, [A], 0.01))
    options = ServiceOptions(engine_urls=(server.url,), engine_kv_events=(f"tcp://127.0.0.1:{kv_port}",))
    try:
        async with (
            open_service(assets, options, tmp_path / "run") as service,
            serving(service.app, access_log=False) as url,
        ):
            controller = service.controller
            assert service.mirrors and service.mirrors[0].active
            async with aiohttp.ClientSession() as http, http.get(url + "/v1/models") as response:
                models = await response.json()
            assert [model["id"] for model in models["data"]] == [served_model_name(assets.model_dir)]
            assert served_model_name(assets.model_dir) == RANDOM_MODEL_NAME  # from its manifest
            first = await controller.answer(serial(QUESTION))
            order = list(first.prompt.document_ids())
            await wait_until(
                lambda: controller.placement.replicas[0].tree.cached_prefix(order).docs == len(order),
                within_s=20,
            )

            hits_before = await counter_total(server.url, "vllm:prefix_cache_hits")
            repeated = await controller.answer(serial(QUESTION))
            reported = await counter_total(server.url, "vllm:prefix_cache_hits") - hits_before
            assert repeated.timeline.cached_prompt_tokens == reported > 0

            other = await controller.answer(serial("What is a frozenset?"))
            assert list(other.prompt.document_ids()) == order
            assert other.timeline.predicted_cached_tokens == other.timeline.cached_prompt_tokens > 0

            server.kill()
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
                for _ in range(3):  # the query that finds it dead, then queries while it is down
                    began = time.perf_counter()
                    assert await rag_status(http, url) == 503
                    assert time.perf_counter() - began < HttpTimeouts().connect_s
                await asyncio.to_thread(server.start)
                ready = time.perf_counter()
                while await rag_status(http, url) != 200:
                    assert time.perf_counter() - ready < 10
                    await asyncio.sleep(0.25)
                # The mirror follows the new engine exactly, within 10 s of its return, and says
                # in /metrics that its event sequence started again.
                mirror = service.mirrors[0]
                await wait_until(lambda: mirror.status.exact, within_s=10 - (time.perf_counter() - ready))
                assert await counter_total(url, "specrag_kv_mirror_sequence_resets") >= 1
            assert service.supervised_engine().restarts == 1
    finally:
        server.stop()
