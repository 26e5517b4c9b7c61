"""TurboRAG's connector on the real in-process vLLM engine (tiny model): claim, load, rotate, save.

The checks read the KV back through the store: a prompt run with the save flag has its whole KV
(loaded spans and computed tokens alike) written there, so what vLLM's blocks held is compared,
not only the sampled tokens (the tiny model's random weights sample nearly constant tokens).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from specrag.errors import InvalidInputError
from specrag.pipeline.document_kv.rope import RopeSpec
from specrag.pipeline.document_kv.store import segment_key
from specrag.pipeline.engines.config import EngineConfig
from specrag.pipeline.engines.protocol import Sampling
from specrag.pipeline.engines.vllm_engine import VllmEngine
from tests.helpers.engines import random_prompt, run_prompt
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.engine

SYSTEM = random_prompt(101, 64)
DOC = random_prompt(102, 96)
QUESTION = random_prompt(103, 21)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def turbo_engine(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[VllmEngine]:
    config = EngineConfig(
        model=str(tiny_model_dir),
        max_model_len=1024,
        kv_cache_gib=1,
        enforce_eager=True,
        startup_timeout_s=600,
        document_kv_dir=str(tmp_path_factory.mktemp("document-kv")),
    )
    engine = await VllmEngine.start(config)
    try:
        yield engine
    finally:
        await engine.close()


def stored(engine: VllmEngine, key: str) -> torch.Tensor:
    assert engine.document_kv is not None
    kv = engine.document_kv.get(key)
    assert kv is not None, f"no stored KV under {key}"
    return kv


def rel_err(actual: torch.Tensor, reference: torch.Tensor) -> float:
    return float((actual.float() - reference.float()).norm() / reference.float().norm())


async def test_fill_stores_each_segment_once(turbo_engine: VllmEngine) -> None:
    assert await turbo_engine.fill_document_kv([SYSTEM, DOC, DOC]) == 2
    assert await turbo_engine.fill_document_kv([SYSTEM, DOC]) == 0
    kv = stored(turbo_engine, segment_key(DOC))
    assert kv.shape[:2] == (2, 2) and kv.shape[3] == len(DOC)  # 2 layers, K and V, every token


async def test_single_document_loaded_equals_full_prefill(turbo_engine: VllmEngine) -> None:
    """Nothing before the document: its stored KV is what a full prefill computes, bit for bit."""
    await turbo_engine.fill_document_kv([DOC])
    prompt = DOC + QUESTION
    await turbo_engine.reset_prefix_cache()
    full = stored(turbo_engine, await turbo_engine.save_prompt_kv(prompt))
    await turbo_engine.reset_prefix_cache()
    turbo = stored(turbo_engine, await turbo_engine.save_prompt_kv(prompt, ((0, len(DOC)),)))
    assert torch.equal(full, turbo)
    await turbo_engine.reset_prefix_cache()  # else the salted blocks just saved serve it
    outputs = await run_prompt(turbo_engine, prompt, Sampling(max_tokens=1, document_kv=((0, len(DOC)),)))
    assert outputs[-1].cached_tokens == len(DOC)  # vLLM counts the loaded tokens as cached
    assert outputs[-1].document_kv_tokens == len(DOC)  # and the connector says they were loaded


async def test_document_loaded_at_an_offset_is_rotated(turbo_engine: VllmEngine) -> None:
    """Behind the system prompt the document's keys are its stored keys rotated by the offset."""
    await turbo_engine.fill_document_kv([SYSTEM, DOC])
    spans = ((0, len(SYSTEM)), (len(SYSTEM), len(SYSTEM) + len(DOC)))
    await turbo_engine.reset_prefix_cache()
    loaded = stored(turbo_engine, await turbo_engine.save_prompt_kv(SYSTEM + DOC + QUESTION, spans))
    alone = stored(turbo_engine, segment_key(DOC))
    rope = RopeSpec.from_config({"head_dim": 32, "rope_parameters": {"rope_theta": 10000.0}})
    doc = slice(len(SYSTEM), len(SYSTEM) + len(DOC))
    assert torch.equal(loaded[:, 1, :, doc], alone[:, 1])  # values carry no position
    # The connector rotates the stored keys (in the engine's dtype) exactly as RopeSpec.shift does;
    # test_rope checks that rotation against reference RoPE implementations.
    assert torch.equal(loaded[:, 0, :, doc], rope.shift(alone[:, 0], len(SYSTEM)))
    assert rel_err(loaded[:, 0, :, doc], alone[:, 0]) > 0.1  # unrotated keys would be far off
    assert torch.equal(loaded[:, :, :, : len(SYSTEM)], stored(turbo_engine, segment_key(SYSTEM)))


async def test_missing_document_is_not_claimed(turbo_engine: VllmEngine) -> None:
    other = random_prompt(104, 64)
    await turbo_engine.reset_prefix_cache()
    outputs = await run_prompt(
        turbo_engine, SYSTEM + other + QUESTION, Sampling(max_tokens=1, document_kv=((0, 64), (64, 128)))
    )
    assert outputs[-1].cached_tokens == 0  # the system prompt alone would leave a gap: no claim


async def test_spans_must_leave_the_question(turbo_engine: VllmEngine) -> None:
    with pytest.raises(InvalidInputError, match="last"):
        await run_prompt(turbo_engine, DOC, Sampling(max_tokens=1, document_kv=((0, len(DOC)),)))


async def test_first_use_fills_the_store_in_the_background(turbo_engine: VllmEngine) -> None:
    doc = random_prompt(105, 64)
    sampling = Sampling(max_tokens=1, document_kv=((0, len(doc)),))
    await turbo_engine.reset_prefix_cache()
    first = await run_prompt(turbo_engine, doc + QUESTION, sampling)
    assert first[-1].document_kv_tokens == 0  # not stored yet: prefilled
    store = turbo_engine.document_kv
    assert store is not None
    await wait_until(lambda: store.contains(segment_key(doc)), within_s=60)
    await turbo_engine.reset_prefix_cache()
    again = await run_prompt(turbo_engine, doc + QUESTION, sampling)
    assert again[-1].document_kv_tokens == len(doc)


DOC2 = random_prompt(106, 64)


async def test_a_document_stored_after_the_system_prompt_is_what_a_full_prefill_computes(
    turbo_engine: VllmEngine,
) -> None:
    """The shared-prefix variant: right after the system prompt, the loaded document is the full
    prefill's KV (the reference: same tokens, same positions), and so is a document prefilled
    fresh after it (tiers)."""
    await turbo_engine.fill_document_kv([SYSTEM])
    assert await turbo_engine.fill_document_kv([DOC], prefix=SYSTEM) == 1
    entry = turbo_engine.document_kv.entry(segment_key(DOC, prefix=SYSTEM))  # type: ignore[union-attr]
    assert entry is not None and entry.first_position == len(SYSTEM) and entry.kv.shape[3] == len(DOC)
    prompt = SYSTEM + DOC + DOC2 + QUESTION
    loaded_end = len(SYSTEM) + len(DOC)
    spans = ((0, len(SYSTEM)), (len(SYSTEM), loaded_end))  # DOC loaded, DOC2 fresh
    await turbo_engine.reset_prefix_cache()
    full = stored(turbo_engine, await turbo_engine.save_prompt_kv(prompt))
    await turbo_engine.reset_prefix_cache()
    tiered = stored(turbo_engine, await turbo_engine.save_prompt_kv(prompt, spans, len(SYSTEM)))
    assert rel_err(tiered[:, :, :, :loaded_end], full[:, :, :, :loaded_end]) < 1e-6  # loaded = reference
    assert rel_err(tiered, full) < 1e-6  # the fresh document and the question too
    await turbo_engine.reset_prefix_cache()
    sampling = Sampling(max_tokens=1, document_kv=spans, document_kv_prefix=len(SYSTEM))
    outputs = await run_prompt(turbo_engine, prompt, sampling)
    assert outputs[-1].document_kv_tokens == loaded_end  # the fresh document was prefilled


async def test_a_shared_prefix_document_further_on_is_rotated_from_where_it_was_computed(
    turbo_engine: VllmEngine,
) -> None:
    """Stored at positions after the system prompt, a document placed later is shifted by the
    difference only; and a document stored alone is never taken for it."""
    await turbo_engine.fill_document_kv([SYSTEM, DOC])
    await turbo_engine.fill_document_kv([DOC, DOC2], prefix=SYSTEM)
    prompt = SYSTEM + DOC + DOC2 + QUESTION
    second = slice(len(SYSTEM) + len(DOC), len(SYSTEM) + len(DOC) + len(DOC2))
    spans = ((0, len(SYSTEM)), (len(SYSTEM), second.start), (second.start, second.stop))
    await turbo_engine.reset_prefix_cache()
    loaded = stored(turbo_engine, await turbo_engine.save_prompt_kv(prompt, spans, len(SYSTEM)))
    after = stored(turbo_engine, segment_key(DOC2, prefix=SYSTEM))
    rope = RopeSpec.from_config({"head_dim": 32, "rope_parameters": {"rope_theta": 10000.0}})
    assert torch.equal(loaded[:, 1, :, second], after[:, 1])
    assert torch.equal(loaded[:, 0, :, second], rope.shift(after[:, 0], len(DOC)))  # 160 - 64, not 160
    alone = stored(turbo_engine, segment_key(DOC))
    assert rel_err(loaded[:, :, :, len(SYSTEM) : second.start], alone) > 1e-3  # not the alone entry
