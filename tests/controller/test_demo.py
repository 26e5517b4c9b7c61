"""The README's main job end to end: default corpus, store and index, real vLLM, real questions."""

from __future__ import annotations

from pathlib import Path

import pytest

from specrag.controller.assets import ensure_assets
from specrag.controller.demo import run_demo
from specrag.paths import DataLayout
from specrag.pipeline.vllm_engine import VllmEngine

pytestmark = pytest.mark.engine


async def test_demo_answers_questions_and_the_repeat_hits_the_prefix_cache(
    tmp_path: Path, tiny_model_dir: Path, vllm_engine: VllmEngine
) -> None:
    layout = DataLayout(tmp_path / "data")
    assets = ensure_assets(layout, model_dir=tiny_model_dir)
    assert layout.corpus_file.is_file() and (layout.index_dir / "manifest.json").is_file()
    # A second call reuses every artefact instead of rebuilding it.
    store_mtime = assets.store.path.stat().st_mtime_ns
    again = ensure_assets(layout, model_dir=tiny_model_dir)
    assert again.store.path.stat().st_mtime_ns == store_mtime

    questions = ["How does asyncio.run create the event loop?", "What does the assert statement do?"]
    answers = await run_demo(vllm_engine, assets, questions, k=4, max_tokens=3)
    assert [a.question for a in answers] == [*questions, questions[0]]
    assert any("asyncio" in passage for passage in answers[0].passages)
    first, repeat = answers[0], answers[-1]
    assert repeat.prompt_tokens == first.prompt_tokens
    full_blocks = (first.prompt_tokens // vllm_engine.block_size) * vllm_engine.block_size
    assert repeat.cached_tokens >= 0.9 * full_blocks
    assert all(a.ttft_ms > 0 and len(a.passages) == 4 for a in answers)
