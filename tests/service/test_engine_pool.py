"""Pools without Ray, as ``specrag serve`` assembles them: two in-process vLLM engines
(``--replicas 2``), and two separate vLLM servers (``--engine-url`` twice, each with its KV
events). Queries are answered through both engines of each pool, and each engine's own KV
events reach its own tree.

Marked ``engine``: each test starts vLLM twice (tiny model, eager).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from pathlib import Path

import pytest

from specrag.client import AsyncClient
from specrag.controller.controller import RagController, RagRequest
from specrag.controller.placement import Placement
from specrag.pipeline.engines.supervisor import SupervisedEngine
from specrag.pipeline.engines.vllm_engine import VllmEngine
from specrag.pipeline.kv_mirror.mirror import WAITING_FOR_CLEAR, KVMirror
from specrag.service.http.app import serving
from specrag.service.run.assembly import Service, ServiceOptions, open_service
from specrag.service.run.assets import Assets
from specrag.service.run.pools import free_port_pair
from tests.helpers.builders import QUESTION, scripted_index
from tests.helpers.http import EngineServer
from tests.helpers.waiting import wait_until

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]


def scripted(assets: Assets) -> Assets:
    """The assets with a search whose documents are fixed (and instant)."""
    return dataclasses.replace(assets, index=scripted_index(assets, [[1, 2, 3]], 0.0))


async def until_exact(controller: RagController, request: RagRequest, mirror: KVMirror) -> None:
    """Wait for the mirror to be exact. A mirror that lost events resets its idle engine's prefix
    cache, and vLLM publishes the reset's AllBlocksCleared only with the engine's next step: while
    it waits for that event, answer a query (round robin: the replicas take turns) so a step runs."""

    async def exact() -> bool:
        if mirror.status.reason == WAITING_FOR_CLEAR:
            await controller.answer(request)
        return mirror.status.exact

    await wait_until(exact, within_s=60, what=lambda: f"{mirror.name}: {mirror.status} {mirror.faults()}")


async def answer_through_both(service: Service) -> None:
    """Four queries under round robin reach both engines, over HTTP too; both trees follow their
    engine's own KV events."""
    controller: RagController = service.controller
    request = RagRequest(QUESTION, k=3, mode="ordering", max_tokens=4)
    answers = await asyncio.wait_for(asyncio.gather(*(controller.answer(request) for _ in range(4))), 120)
    served = {e.detail["replica"] for a in answers for e in a.timeline.events if e.kind == "route"}
    assert served == {"r0", "r1"} and all(a.text for a in answers)
    placement: Placement = service.placement
    mirrors = {mirror.name: mirror for mirror in service.mirrors}
    assert sorted(mirrors) == ["r0", "r1"]
    for mirror in mirrors.values():
        await until_exact(controller, request, mirror)
    # The way back from a loss, on the real engine: the idle engine resets its prefix cache at once,
    # and the AllBlocksCleared of the reset, published with its next step, makes the mirror exact.
    lossy = mirrors["r0"]
    lossy.target.degrade("a batch lost on purpose")
    assert await lossy.recover() and lossy.status.reason == WAITING_FOR_CLEAR
    await until_exact(controller, request, lossy)
    # A mirror that lost events on the way empties its idle engine's cache to be exact again: ask
    # once more, so that each tree shows its own engine's system prompt, arrived by its own events.
    await asyncio.wait_for(asyncio.gather(*(controller.answer(request) for _ in range(2))), 120)
    for replica in placement.replicas:
        await wait_until(
            replica.tree.system_prompt_resident,
            within_s=30,
            what=lambda r=replica: f"{r.name}: {mirrors[r.name].status} {mirrors[r.name].faults()}",  # type: ignore[misc]
        )
    async with serving(service.app, access_log=False) as url, AsyncClient(url) as client:
        result = await client.rag(QUESTION, k=3, mode="ordering", max_tokens=4)
    assert result.answer


async def test_two_in_process_engines_each_on_its_own_core_answer_queries(
    tiny_assets: Assets, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # serve's 8,192-token limit is beyond the tiny model's 4,096 positions; its prompts are short.
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    options = ServiceOptions(replicas=2, router="round_robin", eager=True)
    async with open_service(scripted(tiny_assets), options, tmp_path / "run") as service:
        configs = []
        for replica in service.placement.replicas:  # supervised in-process engines
            supervised = replica.engine
            assert isinstance(supervised, SupervisedEngine) and isinstance(supervised.engine, VllmEngine)
            configs.append(supervised.engine.config)
        cores = sorted(os.sched_getaffinity(0))
        assert [c.omp_threads_bind for c in configs] == [str(cores[i % len(cores)]) for i in range(2)]
        assert len({c.kv_events_endpoint for c in configs}) == 2
        await answer_through_both(service)


async def test_two_engine_servers_given_by_url_answer_queries(tiny_assets: Assets, tmp_path: Path) -> None:
    ports = [free_port_pair(), free_port_pair()]
    servers = [
        EngineServer(tiny_assets.model_dir, tmp_path / f"server-{i}.log", kv_events_port=port)
        for i, port in enumerate(ports)
    ]
    try:
        await asyncio.gather(*(asyncio.to_thread(server.start) for server in servers))
        options = ServiceOptions(
            engine_urls=tuple(server.url for server in servers),
            engine_kv_events=tuple(f"tcp://127.0.0.1:{port}" for port in ports),
            router="round_robin",
        )
        async with open_service(scripted(tiny_assets), options, tmp_path / "run") as service:
            await answer_through_both(service)
    finally:
        for server in servers:
            server.stop()
