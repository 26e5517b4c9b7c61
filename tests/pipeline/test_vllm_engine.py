"""The real vLLM engine through our adapter: prefix caching, abort, warm-up, determinism."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from vllm import SamplingParams

from specrag.errors import InvalidInputError
from specrag.pipeline.engines.protocol import Engine, EngineOutput, Sampling
from specrag.pipeline.engines.vllm_engine import VllmEngine
from tests.helpers.engines import close_stream, random_prompt, run_prompt
from tests.helpers.waiting import engine_idle, wait_until

pytestmark = pytest.mark.engine


def test_adapter_satisfies_the_engine_protocol(vllm_engine: VllmEngine) -> None:
    assert isinstance(vllm_engine, Engine)
    assert vllm_engine.block_size == 32
    assert vllm_engine.kv_capacity_tokens is not None and vllm_engine.kv_capacity_tokens > 4096


async def test_second_submission_is_served_from_the_prefix_cache(vllm_engine: VllmEngine) -> None:
    prompt = random_prompt(seed=1, length=1000)
    first = await run_prompt(vllm_engine, prompt, Sampling(max_tokens=2))
    second = await run_prompt(vllm_engine, prompt, Sampling(max_tokens=2))
    full_blocks_tokens = (len(prompt) // vllm_engine.block_size) * vllm_engine.block_size
    assert first[0].cached_tokens == 0
    assert second[0].cached_tokens is not None
    assert second[0].cached_tokens >= 0.9 * full_blocks_tokens
    assert second[0].prompt_tokens == len(prompt)


async def test_abort_stops_a_long_generation_and_leaves_the_engine_idle(vllm_engine: VllmEngine) -> None:
    request_id = "long-" + uuid.uuid4().hex
    received: list[EngineOutput] = []
    decoding = asyncio.Event()

    async def consume() -> None:
        sampling = Sampling(max_tokens=3000, ignore_eos=True)
        async for output in vllm_engine.generate(request_id, random_prompt(seed=2, length=64), sampling):
            received.append(output)
            decoding.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(decoding.wait(), timeout=30)
    assert vllm_engine.load().decoding == 1
    await vllm_engine.abort(request_id)
    await asyncio.wait_for(task, timeout=5)
    tokens = sum(len(output.token_ids) for output in received)
    assert tokens < 3000
    assert not received[-1].finished or received[-1].finish_reason == "abort"
    await wait_until(lambda: engine_idle(vllm_engine))
    assert vllm_engine.load().prefilling == 0 and vllm_engine.load().decoding == 0


async def test_cancelling_the_consumer_aborts_the_request(vllm_engine: VllmEngine) -> None:
    async def consume() -> None:
        sampling = Sampling(max_tokens=3000, ignore_eos=True)
        async for _ in vllm_engine.generate(uuid.uuid4().hex, random_prompt(seed=3, length=64), sampling):
            pass

    task = asyncio.create_task(consume())
    await asyncio.sleep(1.0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_until(lambda: engine_idle(vllm_engine))


async def test_warm_up_makes_the_prefix_cached_for_the_next_prompt(vllm_engine: VllmEngine) -> None:
    prefix = random_prompt(seed=4, length=640)
    warm = await vllm_engine.warm(prefix, "warm-" + uuid.uuid4().hex)
    assert warm.cached_tokens == 0 and not warm.was_cached
    prompt = prefix + random_prompt(seed=5, length=100)
    outputs = await run_prompt(vllm_engine, prompt, Sampling(max_tokens=1))
    # Every full block of the prefix except the one vLLM recomputes for an exact repeat.
    assert outputs[0].cached_tokens is not None
    assert outputs[0].cached_tokens >= (len(prefix) // vllm_engine.block_size - 1) * vllm_engine.block_size
    again = await vllm_engine.warm(prefix, "warm-" + uuid.uuid4().hex)
    assert again.was_cached


async def test_greedy_output_is_deterministic(vllm_engine: VllmEngine) -> None:
    prompt = random_prompt(seed=6, length=300)
    sampling = Sampling(max_tokens=24, ignore_eos=True)
    first = [
        token for output in await run_prompt(vllm_engine, prompt, sampling) for token in output.token_ids
    ]
    await vllm_engine.reset_prefix_cache()
    second = [
        token for output in await run_prompt(vllm_engine, prompt, sampling) for token in output.token_ids
    ]
    assert len(first) == 24
    assert first == second


async def test_penalties_reach_vllms_sampling_params(
    vllm_engine: VllmEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a request asks against repetition is what vLLM decodes with."""
    seen: list[SamplingParams] = []
    generate = vllm_engine._llm.generate

    def spied(prompt: Any, params: SamplingParams, request_id: str) -> Any:
        seen.append(params)
        return generate(prompt, params, request_id)

    monkeypatch.setattr(vllm_engine._llm, "generate", spied)
    assert vllm_engine.honours_penalties
    sampling = Sampling(max_tokens=4, frequency_penalty=0.5, presence_penalty=-0.25, repetition_penalty=1.3)
    outputs = await run_prompt(vllm_engine, random_prompt(seed=10, length=64), sampling)
    assert outputs[-1].finished
    params = seen[-1]
    assert (params.frequency_penalty, params.presence_penalty, params.repetition_penalty) == (0.5, -0.25, 1.3)
    await run_prompt(vllm_engine, random_prompt(seed=10, length=64), 2)
    assert (seen[-1].frequency_penalty, seen[-1].presence_penalty, seen[-1].repetition_penalty) == (0, 0, 1)


async def test_prompt_longer_than_the_model_allows_is_rejected_before_submission(
    vllm_engine: VllmEngine,
) -> None:
    too_long = random_prompt(seed=7, length=vllm_engine.max_model_len)
    with pytest.raises(InvalidInputError, match="exceeds the model's limit"):
        await run_prompt(vllm_engine, too_long, Sampling(max_tokens=8))
    assert vllm_engine.load().prefilling == 0


async def test_duplicate_request_id_is_rejected(vllm_engine: VllmEngine) -> None:
    request_id = "dup-" + uuid.uuid4().hex
    stream = vllm_engine.generate(request_id, random_prompt(seed=8, length=64), Sampling(max_tokens=200))
    first = await anext(stream)
    assert first.request_id == request_id
    with pytest.raises(InvalidInputError, match="already in flight"):
        await run_prompt(vllm_engine, random_prompt(seed=9, length=64), 2, request_id=request_id)
    await close_stream(stream)
    await wait_until(lambda: engine_idle(vllm_engine))
