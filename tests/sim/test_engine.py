"""The simulated engine: vLLM's APC rule (checked against the real engine), chunks, eviction, faults."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence

import pytest

from specrag.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from specrag.cache.residency import BlockPool, chain_block_keys
from specrag.errors import EngineError, InvalidInputError
from specrag.pipeline.engines.protocol import Engine, EngineOutput, Sampling
from specrag.pipeline.engines.vllm_engine import VllmEngine
from specrag.sim.engine import SimulatedEngine
from specrag.sim.requests import TimeModel
from tests.helpers.engines import close_stream, random_prompt, run_prompt
from tests.helpers.waiting import engine_idle, wait_until

FAST = 0.001
"""time_scale for these tests: a 1 s simulated prefill takes 1 ms."""


async def _cached(engine: Engine, prompt: Sequence[int]) -> int | None:
    return (await run_prompt(engine, prompt))[0].cached_tokens


def _tokens(outputs: Sequence[EngineOutput]) -> list[int]:
    return [token for output in outputs for token in output.token_ids]


async def _frozen(engine: SimulatedEngine) -> None:
    """Stall the engine and wait for the step in progress to finish, so its state holds still."""
    engine.stall()
    steps = -1
    while steps != engine.steps:
        steps = engine.steps
        await asyncio.sleep(0.02)


# The sequence compared with the real engine: exact repeats of several lengths (the last-block
# rule), a prefix then an extension of it, and a prompt that diverges mid-block.
_SHARED = random_prompt(seed=30, length=100)
APC_SEQUENCE = [
    random_prompt(seed=31, length=1000),
    random_prompt(seed=31, length=1000),
    random_prompt(seed=32, length=1024),
    random_prompt(seed=32, length=1024),
    random_prompt(seed=33, length=640),
    random_prompt(seed=33, length=640),
    random_prompt(seed=33, length=640) + random_prompt(seed=34, length=100),
    random_prompt(seed=35, length=33),
    random_prompt(seed=35, length=33),
    _SHARED + random_prompt(seed=36, length=200),
    _SHARED + random_prompt(seed=37, length=200),
]
APC_EXPECTED = [0, 992, 0, 992, 0, 608, 640, 0, 32, 0, 96]


async def test_cached_tokens_follow_vllms_rule() -> None:
    engine = SimulatedEngine(time_scale=FAST)
    assert isinstance(engine, Engine)
    assert [await _cached(engine, prompt) for prompt in APC_SEQUENCE] == APC_EXPECTED
    await engine.close()


@pytest.mark.engine
async def test_cached_tokens_match_the_real_engine(vllm_engine: VllmEngine) -> None:
    simulated = SimulatedEngine(block_size=vllm_engine.block_size, time_scale=FAST)
    await vllm_engine.reset_prefix_cache()
    real = [await _cached(vllm_engine, prompt) for prompt in APC_SEQUENCE]
    assert real == [await _cached(simulated, prompt) for prompt in APC_SEQUENCE]
    await simulated.close()


async def test_every_output_carries_the_cache_hit_and_the_answer_is_deterministic() -> None:
    engine = SimulatedEngine(time_scale=FAST)
    prompt = random_prompt(seed=1, length=300)
    first = await run_prompt(engine, prompt, 5)
    await engine.reset_prefix_cache()
    second = await run_prompt(engine, prompt, 5)
    assert len(_tokens(first)) == 5 and _tokens(first) == _tokens(second)
    assert _tokens(first) != _tokens(await run_prompt(engine, random_prompt(seed=2, length=300), 5))
    assert all(output.cached_tokens == 0 for output in second)
    assert [output.finished for output in first] == [False] * 4 + [True]
    assert first[-1].finish_reason == "length" and first[0].prompt_tokens == 300
    await engine.close()


async def test_an_abort_mid_prefill_leaves_the_computed_chunks_cached() -> None:
    stored: list[KVEvent] = []

    def on_events(events: Sequence[KVEvent]) -> None:
        stored.extend(events)
        if len(stored) == 16:  # two 256-token chunks of 32-token blocks: hold the engine there
            engine.stall()

    engine = SimulatedEngine(time_scale=FAST, long_prefill_token_threshold=256, on_kv_events=on_events)
    prompt = random_prompt(seed=3, length=2048)
    stream = engine.generate("aborted", prompt, Sampling(max_tokens=1))
    first = asyncio.ensure_future(anext(stream))
    await wait_until(lambda: len(stored) >= 16, every_s=0.001)
    await engine.abort("aborted")
    aborted = await first
    assert aborted.finished and aborted.finish_reason == "abort" and not aborted.token_ids
    engine.resume()
    await wait_until(lambda: engine_idle(engine), every_s=0.001)
    assert len(stored) == 16
    assert await _cached(engine, prompt) == 512
    await engine.close()


async def test_least_recently_used_prompt_is_evicted_tail_first() -> None:
    events: list[KVEvent] = []
    engine = SimulatedEngine(
        time_scale=FAST, capacity_blocks=48, max_model_len=1536, on_kv_events=events.extend
    )
    a, b = random_prompt(seed=4, length=1024), random_prompt(seed=5, length=1024)
    await run_prompt(engine, a)
    await run_prompt(engine, b)  # 16 never-used blocks, then the last 16 of a's 32
    removed = {key for event in events if isinstance(event, BlockRemoved) for key in event.block_hashes}
    assert removed == set(chain_block_keys(a, 32)[16:])
    assert engine.cached_blocks == 48
    assert await _cached(engine, a) == 512  # its first 16 blocks; its 16 new ones evict b's tail
    assert await _cached(engine, b) == 512
    await engine.close()


async def test_its_pool_holds_what_the_shared_block_pool_model_predicts() -> None:
    """The knowledge tree's capacity model and the ordering benchmark run prompts through the same
    BlockPool in one go; step by step, in chunks, the engine must end up holding the same blocks."""
    resident: set[int] = set()

    def mirror(events: Sequence[KVEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                resident.update(int(key) for key in event.block_hashes)
            elif isinstance(event, BlockRemoved):
                resident.difference_update(int(key) for key in event.block_hashes)

    engine = SimulatedEngine(time_scale=FAST, capacity_blocks=40, max_model_len=1280, on_kv_events=mirror)
    model = BlockPool(40)
    rng = random.Random(40)
    system = random_prompt(seed=41, length=64)
    documents = [random_prompt(seed=50 + i, length=32 * rng.randint(2, 4)) for i in range(6)]
    seen: set[int] = set()
    for turn in range(30):
        question = random_prompt(seed=100 + turn, length=32)  # a unique last block, like every real prompt
        prompt = system + [t for doc in rng.sample(documents, 3) for t in doc] + question
        keys = chain_block_keys(prompt, 32)
        seen.update(keys)
        predicted = model.serve(keys)
        assert await _cached(engine, prompt) == predicted.cached_blocks * 32
        assert resident == {key for key in seen if key in model}
    assert len(seen) > 2 * 40  # far more blocks were stored than fit: eviction decided the outcome
    assert len(resident) == engine.cached_blocks == 40
    await engine.close()


async def test_kv_events_describe_the_stored_chain_and_the_reset() -> None:
    events: list[KVEvent] = []
    engine = SimulatedEngine(time_scale=FAST, on_kv_events=events.extend)
    prompt = random_prompt(seed=6, length=100)
    await run_prompt(engine, prompt)
    keys = chain_block_keys(prompt, 32)
    stored = [event for event in events if isinstance(event, BlockStored)]
    assert [event.block_hashes[0] for event in stored] == keys
    assert [event.parent_block_hash for event in stored] == [None, *keys[:-1]]
    assert [event.token_ids for event in stored] == [tuple(prompt[i : i + 32]) for i in (0, 32, 64)]
    await engine.reset_prefix_cache()
    assert events[-1] == AllBlocksCleared()
    assert engine.cached_blocks == 0 and await _cached(engine, prompt) == 0
    await engine.close()


async def test_reset_waits_while_blocks_are_in_use_and_happens_once_they_are_free() -> None:
    engine = SimulatedEngine(time_scale=0.05)  # 8000 decode steps: seconds, the reset waits on them
    prompt = random_prompt(seed=7, length=64)
    stream = engine.generate("busy", prompt, Sampling(max_tokens=8000))
    await anext(stream)
    reset = asyncio.ensure_future(engine.reset_prefix_cache())
    await asyncio.sleep(0.2)
    assert not reset.done() and engine.cached_blocks > 0  # refused: the busy request holds blocks
    await close_stream(stream)
    await asyncio.wait_for(reset, 5)
    assert engine.cached_blocks == 0 and await _cached(engine, prompt) == 0
    await engine.close()


async def test_counts_are_exact_and_abort_takes_effect_at_the_next_step() -> None:
    engine = SimulatedEngine(time_scale=FAST, max_num_seqs=2)
    streams = [
        engine.generate(f"r{i}", random_prompt(seed=10 + i, length=64), Sampling(max_tokens=5000))
        for i in range(3)
    ]
    await _frozen(engine)
    firsts = [asyncio.ensure_future(anext(stream)) for stream in streams]
    await asyncio.sleep(0.01)
    assert (await engine.counts()).__dict__ == {"running": 0, "waiting": 3, "unfinished": 3}
    engine.resume()
    await asyncio.wait_for(asyncio.gather(*firsts[:2]), timeout=5)
    await _frozen(engine)
    assert (await engine.counts()).__dict__ == {"running": 2, "waiting": 1, "unfinished": 3}
    assert engine.load().decoding == 2 and engine.load().prefilling == 1
    await engine.abort("r0")
    assert (await engine.counts()).__dict__ == {"running": 2, "waiting": 1, "unfinished": 2}
    engine.resume()
    await asyncio.wait_for(firsts[2], timeout=5)
    await _frozen(engine)
    assert (await engine.counts()).__dict__ == {"running": 2, "waiting": 0, "unfinished": 2}
    for stream in streams:
        await close_stream(stream)
    engine.resume()
    await wait_until(lambda: engine_idle(engine), every_s=0.001)
    assert engine.load().decoding == 0
    await engine.close()


async def test_a_cached_request_overtakes_a_long_cold_prefill() -> None:
    engine = SimulatedEngine(time_scale=0.1, long_prefill_token_threshold=256, max_num_batched_tokens=512)
    short = random_prompt(seed=12, length=200)
    await run_prompt(engine, short)
    order: list[str] = []

    async def first_token(name: str, prompt: list[int]) -> None:
        async for _ in engine.generate(name, prompt, Sampling(max_tokens=1)):
            order.append(name)

    long_task = asyncio.create_task(first_token("long", random_prompt(seed=13, length=4000)))
    steps = engine.steps
    await wait_until(
        lambda: engine.steps > steps, every_s=0.001
    )  # its first chunk is computed: it has 15 to go
    await first_token("short", short)
    await long_task
    assert order == ["short", "long"]
    await engine.close()


async def test_preemption_under_block_pressure_still_completes_both_answers() -> None:
    engine = SimulatedEngine(time_scale=FAST, capacity_blocks=64, max_model_len=2048)
    prompts = [random_prompt(seed=14, length=1000), random_prompt(seed=15, length=1000)]
    together = await asyncio.gather(*(run_prompt(engine, prompt, 600) for prompt in prompts))
    alone = SimulatedEngine(time_scale=FAST, capacity_blocks=64, max_model_len=2048)
    for prompt, outputs in zip(prompts, together, strict=True):
        assert _tokens(outputs) == _tokens(await run_prompt(alone, prompt, 600))
    assert (await engine.counts()).__dict__ == {"running": 0, "waiting": 0, "unfinished": 0}
    await engine.close()
    await alone.close()


async def test_simulated_time_follows_the_profile() -> None:
    model = TimeModel(decode_step_s=0.5, step_overhead_s=0.01)
    engine = SimulatedEngine(time_model=model, time_scale=0.0, long_prefill_token_threshold=256)
    await run_prompt(engine, random_prompt(seed=16, length=1024), 3)
    assert engine.steps == 4 + 2
    assert engine.simulated_time_s == pytest.approx(0.21 + 6 * 0.01 + 2 * 0.5)
    await engine.close()


async def test_injected_failures_hangs_and_death() -> None:
    engine = SimulatedEngine(time_scale=FAST)
    prompt = random_prompt(seed=17, length=64)
    engine.fail_next(2)
    for _ in range(2):
        with pytest.raises(EngineError, match="injected"):
            await run_prompt(engine, prompt)
    assert len(await run_prompt(engine, prompt)) == 1
    assert engine.load().prefilling == 0

    loop = asyncio.get_running_loop()
    engine.hang(0.3)
    started = loop.time()
    await run_prompt(engine, prompt)
    assert loop.time() - started >= 0.25

    stream = engine.generate("doomed", prompt, Sampling(max_tokens=5000))
    await anext(stream)
    await engine.die()
    with pytest.raises(EngineError, match="died"):
        async for _ in stream:
            pass
    with pytest.raises(EngineError, match="died"):
        await run_prompt(engine, prompt)
    with pytest.raises(EngineError):
        await engine.counts()
    await engine.close()


async def test_a_bug_in_the_step_loop_fails_the_streams_and_closes_the_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = SimulatedEngine(time_scale=FAST)

    def broken_schedule() -> list[object]:
        raise RuntimeError("scheduler bug")

    monkeypatch.setattr(engine, "_schedule", broken_schedule)
    with pytest.raises(EngineError, match=r"step loop failed.*scheduler bug"):
        await run_prompt(engine, random_prompt(seed=20, length=64))
    assert engine.load().prefilling == 0
    with pytest.raises(EngineError, match="scheduler bug"):
        await engine.counts()
    await engine.close()


async def test_inputs_are_validated() -> None:
    engine = SimulatedEngine(time_scale=FAST, max_model_len=256, capacity_blocks=8)
    with pytest.raises(InvalidInputError, match="exceeds the model's limit"):
        await run_prompt(engine, random_prompt(seed=18, length=256))
    stream = engine.generate("same", random_prompt(seed=19, length=10), Sampling(max_tokens=100))
    await anext(stream)
    with pytest.raises(InvalidInputError, match="already in flight"):
        await run_prompt(engine, [5, 6, 7], request_id="same")
    await close_stream(stream)
    with pytest.raises(InvalidInputError, match="cannot hold"):
        SimulatedEngine(capacity_blocks=4, block_size=32, max_model_len=256)
    await engine.close()
    with pytest.raises(EngineError, match="closed"):
        await run_prompt(engine, random_prompt(seed=18, length=10))
