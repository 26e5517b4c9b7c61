"""The document API on the real engine: a new fact is retrieved and cited, a replacement is prompted
with none of the old text's cached blocks, a deleted document is never retrieved again."""

from __future__ import annotations

from pathlib import Path

import pytest

from specrag.client import AsyncClient
from specrag.pipeline.engines.vllm_engine import VllmEngine
from specrag.service.http.app import create_app, serving
from specrag.service.run.assets import Assets
from tests.helpers.builders import make_controller
from tests.helpers.live_corpus import QUOKKA_FACT, QUOKKA_QUESTION, live_assets

pytestmark = pytest.mark.engine


async def test_put_replace_and_delete_on_the_real_engine(
    vllm_engine: VllmEngine, tiny_assets: Assets, tmp_path: Path
) -> None:
    assets = live_assets(tiny_assets, tmp_path / "log.sqlite")
    assert assets.corpus is not None
    controller = make_controller(vllm_engine, assets)
    app = create_app(controller, corpus=assets.corpus)
    try:
        async with serving(app, access_log=False) as url, AsyncClient(url) as client:
            assert (await client.put_document("quokka", QUOKKA_FACT, title="quokka module"))["version"] == 1
            answer = await client.rag(QUOKKA_QUESTION, k=4, max_tokens=4)
            assert answer.documents[0] == "quokka" and answer.sources[0]["id"] == "quokka"

            replaced = "The quokka module now counts marsupials with quokka.tally() instead."
            assert (await client.put_document("quokka", replaced, title="quokka module"))["version"] == 2
            answer = await client.rag(QUOKKA_QUESTION, k=4, max_tokens=4)
            assert answer.documents[0] == "quokka"
            # The new version's segment was never prefilled: none of its tokens can come from the cache.
            new_segment = len(assets.store.tokens(assets.store.row_of("quokka")))
            timeline = answer.timeline
            assert timeline["cached_prompt_tokens"] <= timeline["prompt_tokens"] - new_segment

            await client.delete_document("quokka")
            answer = await client.rag(QUOKKA_QUESTION, k=4, max_tokens=4)
            assert "quokka" not in answer.documents
    finally:
        await controller.close()
