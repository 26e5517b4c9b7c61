"""The GPU-pace stand-in: vLLM's block hashes and events, its LRU cache, its HTTP face, a clean stop,
and, through the service's own assembly, a KV mirror whose predicted cached tokens equal those the
stand-in delivered (as tests/service/test_mirror_live.py shows for vLLM itself)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from collections.abc import Sequence

import aiohttp
import pytest
from vllm import SamplingParams
from vllm.distributed import kv_events as vllm_events
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, maybe_convert_block_hash
from vllm.v1.request import Request as VllmRequest

from specrag.controller.config import ControllerConfig
from specrag.controller.controller import RagRequest
from specrag.controller.query import AnswerDone
from specrag.pipeline.engines.config import KVEventSource
from specrag.pipeline.engines.http_engine import HttpEngine
from specrag.pipeline.engines.protocol import Sampling
from specrag.service.run.assembly import open_controller, prompt_builder
from specrag.service.run.assets import Assets
from specrag.service.run.pools import free_port_pair
from specrag.sim.gpu_server.engine import FINISHED, Request, StepEngine
from specrag.sim.gpu_server.prefix_cache import HASH_ALGORITHM, PrefixCache
from specrag.sim.gpu_server.server import StandInServer, StandInSettings
from specrag.sim.gpu_server.time_model import TimeModel
from tests.helpers.http import free_port
from tests.helpers.waiting import wait_until

BLOCK = 4


def test_block_hashes_are_vllms_own() -> None:
    prompt = list(range(10, 31))  # five full blocks and a partial one
    cache = PrefixCache(num_blocks=16, block_size=BLOCK)
    hash_fn = get_hash_fn_by_name(HASH_ALGORITHM)
    init_none_hash(hash_fn)
    request = VllmRequest(
        "r", prompt, SamplingParams(max_tokens=1), None, block_hasher=get_request_block_hasher(BLOCK, hash_fn)
    )
    assert cache.hash_blocks(prompt) == list(request.block_hashes)
    assert len(request.block_hashes) == 5


def stored(events: Sequence[object]) -> list[object]:
    return [h for e in events if isinstance(e, vllm_events.BlockStored) for h in e.block_hashes]


def removed(events: Sequence[object]) -> list[object]:
    return [h for e in events if isinstance(e, vllm_events.BlockRemoved) for h in e.block_hashes]


async def test_a_repeat_hits_all_but_its_last_block_and_the_least_recently_freed_go_first() -> None:
    batches: list[vllm_events.KVEventBatch] = []
    times = TimeModel(prefill_s_per_token=0.0, step_s=0.001)
    engine = StepEngine(PrefixCache(num_blocks=6, block_size=BLOCK), times, batches.append)
    engine.start()
    try:
        first, second = list(range(1, 13)), list(range(50, 62))  # three blocks each, one answer token

        async def run(request_id: str, prompt: list[int]) -> int:
            request = Request(request_id, prompt, 1, 0.0)
            engine.submit(request)
            while await request.tokens.get() != FINISHED:
                pass
            return request.cached_tokens

        assert await run("a", first) == 0
        assert await run("b", first) == 8  # the block holding the last prompt token is computed again
        assert await run("c", second) == 0  # 3 + 1 blocks: the first prompt's tail block goes first
        events = [event for batch in batches for event in batch.events]
        first_hashes = [maybe_convert_block_hash(h) for h in engine.cache.hash_blocks(first)]
        assert stored(events)[:3] == first_hashes
        assert removed(events) == [first_hashes[2]]
        assert engine.cache.reset() is True and isinstance(
            engine.cache.take_events()[0], vllm_events.AllBlocksCleared
        )
    finally:
        await engine.stop()


async def test_http_face_rejects_bad_prompts_and_resets_only_when_idle() -> None:
    port, events_port = free_port(), free_port_pair()
    async with StandInServer(StandInSettings(port=port, kv_events_port=events_port, max_model_len=64)):
        engine = await HttpEngine.connect(f"http://127.0.0.1:{port}")
        try:
            assert (engine.block_size, engine.max_model_len) == (16, 64)
            outputs = [o async for o in engine.generate("q", list(range(1, 40)), Sampling(max_tokens=3))]
            assert outputs[-1].finish_reason == "length" and outputs[-1].cached_tokens == 0
            await engine.reset_prefix_cache()  # idle: vLLM's reset succeeds
            async with aiohttp.ClientSession() as session:
                url = f"http://127.0.0.1:{port}/v1/completions"
                for body in ({"prompt": "text", "stream": True}, {"prompt": [1] * 70, "stream": True}):
                    async with session.post(url, json=body) as response:
                        assert response.status == 400
                        assert "message" in (await response.json())["error"]
                async with session.get(f"http://127.0.0.1:{port}/standin/requests") as response:
                    (record,) = (await response.json())["requests"]
            assert record["request_id"] == "q" and record["modelled_ttft_s"] > 0
        finally:
            await engine.close()


def test_the_command_stops_cleanly_on_sigterm() -> None:
    port, events_port = free_port(), free_port_pair()
    command = [
        sys.executable,
        "-m",
        "specrag.sim.gpu_server",
        "--port",
        str(port),
        "--kv-events-port",
        str(events_port),
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert process.stdout is not None
        assert "GPU stand-in on" in process.stdout.readline()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.timeout(300)
async def test_the_mirror_predicts_the_cached_tokens_the_stand_in_delivers(tiny_assets: Assets) -> None:
    """Concurrent identical questions, enough others to evict them, then the first ones again."""
    port, events_port = free_port(), free_port_pair()
    settings = StandInSettings(port=port, kv_events_port=events_port, max_model_len=4096, num_blocks=256)
    async with StandInServer(settings):
        engine = await HttpEngine.connect(f"http://127.0.0.1:{port}")
        source = KVEventSource.remote(f"tcp://127.0.0.1:{events_port}")
        questions = [f"What does {passage.title} say?" for passage in tiny_assets.passages[::7][:27]]
        first, others = questions[:3], questions[3:]
        try:
            builder = prompt_builder(tiny_assets, engine)
            async with open_controller(
                engine, source, tiny_assets.index, builder, ControllerConfig(), empty_cache=True
            ) as (controller, mirror):
                assert mirror is not None

                async def ask(question: str) -> AnswerDone:
                    return await controller.answer(RagRequest(question, k=3, mode="ordering", max_tokens=2))

                answers: list[AnswerDone] = []
                for question in first:
                    answers += await asyncio.gather(*(ask(question) for _ in range(4)))
                for question in others:
                    answers.append(await ask(question))
                for question in first:
                    answers.append(await ask(question))
                timelines = [done.timeline for done in answers]
                pairs = [(t.predicted_cached_tokens, t.cached_prompt_tokens) for t in timelines]
                assert [pair for pair in pairs if pair[0] != pair[1]] == []
                assert sum(delivered for _, delivered in pairs) > 0  # the cache was used, not only cold
                await wait_until(lambda: mirror.status.exact, within_s=10)
                assert (
                    mirror.faults().lost_batches == 0 and mirror.tree.mirror_counts.expired_predictions == 0
                )
                assert mirror.tree.mirror_counts.unknown_removals >= 0
        finally:
            await engine.close()
        assert sum(t.prompt_tokens for t in timelines[12:-3]) > 2 * settings.num_blocks * 16
