"""The README's main job end to end: default corpus, store and index, the service on real vLLM."""

from __future__ import annotations

from pathlib import Path

import pytest

from specrag.client import AsyncClient
from specrag.paths import DataLayout
from specrag.pipeline.engines.vllm_engine import VllmEngine
from specrag.service.cli.demo import run_demo
from specrag.service.http.app import create_app, serving
from specrag.service.run.assets import ensure_assets
from tests.helpers.builders import make_controller

pytestmark = pytest.mark.engine


async def test_demo_answers_questions_and_the_repeat_hits_the_prefix_cache(
    tmp_path: Path, tiny_model_dir: Path, vllm_engine: VllmEngine, capsys: pytest.CaptureFixture[str]
) -> None:
    layout = DataLayout(tmp_path / "data")
    assets = ensure_assets(layout, model=tiny_model_dir)
    assert layout.corpus_file.is_file() and (layout.index_dir / "manifest.json").is_file()
    # A second call reuses every artefact instead of rebuilding it.
    store_mtime = assets.store.path.stat().st_mtime_ns
    again = ensure_assets(layout, model=tiny_model_dir)
    assert again.store.path.stat().st_mtime_ns == store_mtime

    controller = make_controller(vllm_engine, assets)
    questions = ["How does asyncio.run create the event loop?", "What does the assert statement do?"]
    try:
        async with serving(create_app(controller)) as url, AsyncClient(url) as client:
            answers = await run_demo(client, questions, k=4, max_tokens=3)
    finally:
        await controller.close()
    assert len(answers) == 3
    assert any("asyncio" in passage for passage in answers[0].documents)
    first, repeat = answers[0].timeline, answers[-1].timeline
    assert repeat["documents"] == first["documents"] and repeat["prompt_tokens"] == first["prompt_tokens"]
    full_blocks = (first["prompt_tokens"] // vllm_engine.block_size) * vllm_engine.block_size
    assert repeat["cached_prompt_tokens"] >= 0.9 * full_blocks
    assert all(a.timeline["ttft_ms"] > 0 and len(a.documents) == 4 for a in answers)
    printed = capsys.readouterr().out
    assert printed.count("Q: ") == 3 and "not overlapped" in printed and "from the prefix cache" in printed
    # Every answer names its sources: the titles of the passages it was generated from, best first.
    for answer in answers:
        assert [source["id"] for source in answer.sources] == answer.documents
        assert all(
            source["title"] == assets.store.passage(assets.store.row_of(source["id"])).title
            for source in answer.sources
        )
    assert printed.count("sources: Python ") == 3
