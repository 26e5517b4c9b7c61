"""An answer survives its replica: a replica that dies mid-answer hands the answer to another one,
which continues from the prompt plus the tokens already sent, and the client's stream is whole.

Over HTTP twice: on two simulated replicas (fast, exact token counts), and on two real vLLM
engines of a ``--replicas 2`` pool whose engine core is killed with SIGKILL while the answer
streams (marked ``engine``). The retry policy itself is tested in
tests/controller/test_retried_flight.py.
"""

from __future__ import annotations

import dataclasses
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from specrag.client import AsyncClient
from specrag.controller.replicas import Replica
from specrag.pipeline.engines.supervisor import SupervisedEngine
from specrag.pipeline.engines.vllm_engine import VllmEngine
from specrag.service.http.app import serving
from specrag.service.run.assembly import ServiceOptions, open_service
from specrag.service.run.assets import Assets
from specrag.sim.engine import SimulatedEngine
from tests.helpers.builders import QUESTION, pool_controller, scripted_index, simulated_pool
from tests.helpers.http import metric, running

MAX_TOKENS = 60


def engine_core_pid(replica: Replica) -> int:
    """The engine-core process of a replica's in-process vLLM engine (from vLLM's process
    manager, as :meth:`VllmEngine.known_failure` reads it)."""
    supervised = replica.engine
    assert isinstance(supervised, SupervisedEngine) and isinstance(supervised.engine, VllmEngine)
    client = getattr(supervised.engine._llm, "engine_core", None)
    manager = getattr(getattr(client, "resources", None), "engine_manager", None)
    processes: list[Any] = list(getattr(manager, "processes", ()))
    assert len(processes) == 1
    return int(processes[0].pid)


async def test_a_replica_that_dies_mid_answer_leaves_the_clients_stream_whole(tiny_assets: Assets) -> None:
    pool = simulated_pool(tiny_assets, 2)
    controller = pool_controller(pool, tiny_assets, scripted_index(tiny_assets, [[1, 2, 3]], 0.0))
    async with running(controller) as url, AsyncClient(url) as client:
        async with client.stream_rag(QUESTION, k=3, mode="ordering", max_tokens=MAX_TOKENS) as stream:
            deltas = []
            async for text in stream:
                deltas.append(text)
                if len(deltas) == 1:
                    (serving_replica,) = [r for r in pool if r.engine.load().decoding]
                    engine = serving_replica.engine
                    assert isinstance(engine, SimulatedEngine)
                    await engine.die()
        metrics = await client.metrics_text()
    text = "".join(deltas)
    assert stream.answer == text and stream.finish_reason == "length"
    assert len(text.split()) == MAX_TOKENS  # the simulated engine says " t<token>" per token
    timeline = stream.timeline
    assert timeline is not None and timeline["migrations"] == 1
    (move,) = [event for event in timeline["events"] if event["kind"] == "migrate"]
    assert move["replica"] == serving_replica.name and move["to"] != serving_replica.name
    assert 0 < move["tokens_sent"] < MAX_TOKENS
    assert metric(metrics, "specrag_migrations_total") == 1
    assert controller.in_flight_request_ids() == set()
    for replica in pool:
        await replica.engine.close()


@pytest.mark.engine
@pytest.mark.timeout(600)
async def test_a_killed_vllm_replica_mid_answer_leaves_the_stream_whole(
    tiny_assets: Assets, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")  # serve's limit is beyond the tiny model's
    assets = dataclasses.replace(tiny_assets, index=scripted_index(tiny_assets, [[1, 2, 3]], 0.0))
    options = ServiceOptions(replicas=2, eager=True)
    async with open_service(assets, options, tmp_path / "run") as service:
        replicas: tuple[Replica, ...] = service.placement.replicas
        async with serving(service.app, access_log=False) as url, AsyncClient(url) as client:
            messages = [{"role": "user", "content": QUESTION}]
            chunks = []
            stream = await client.chat(messages, stream=True, k=3, mode="ordering", max_tokens=MAX_TOKENS)
            async with stream:
                async for chunk in stream:
                    chunks.append(chunk)
                    if len(chunks) == 1:
                        (victim,) = [i for i, r in enumerate(replicas) if r.engine.load().decoding]
                        os.kill(engine_core_pid(replicas[victim]), signal.SIGKILL)
            metrics = await client.metrics_text()
        service.begin_shutdown()
    timeline = stream.timeline
    assert timeline is not None
    assert timeline["migrations"] == 1, timeline["events"]
    (move,) = [event for event in timeline["events"] if event["kind"] == "migrate"]
    assert move["replica"] == replicas[victim].name and 0 < move["tokens_sent"] < MAX_TOKENS
    # One whole answer: every token up to max_tokens (or the model's end of text), then the end.
    last = chunks[-1]
    assert last["choices"][0]["finish_reason"] in ("length", "stop")
    if last["choices"][0]["finish_reason"] == "length":
        assert last["usage"]["completion_tokens"] == MAX_TOKENS
    assert metric(metrics, "specrag_migrations_total") == 1
    assert all(isinstance(r.engine, SupervisedEngine) for r in replicas)
