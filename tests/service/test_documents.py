"""The document API over HTTP on the simulated engine: a change is answered, retrieved and prompted.

The same on the real engine: tests/service/test_documents_engine.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import aiohttp
import pytest

from specrag.cli import main
from specrag.client import AsyncClient, SpecragHTTPError
from specrag.controller.query import RagRequest
from specrag.pipeline.engines.protocol import EngineOutput, Sampling
from specrag.pipeline.store.document_writes import MAX_BATCH_DOCUMENTS
from specrag.retrieval.corpus import Passage
from specrag.service.http.access import Access
from specrag.service.http.app import create_app, serving
from specrag.service.run.assets import Assets
from specrag.sim.engine import SimulatedEngine
from tests.helpers.builders import make_controller
from tests.helpers.http import TOKEN
from tests.helpers.live_corpus import QUOKKA_FACT, QUOKKA_QUESTION, live_assets

WRITER = "writer-token-456"


class PromptRecordingEngine(SimulatedEngine):
    """The simulated engine, remembering every prompt submitted to it."""

    def __init__(self) -> None:
        super().__init__(time_scale=0.01, max_model_len=4096)
        self.prompts: list[tuple[int, ...]] = []

    def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], sampling: Sampling
    ) -> AsyncIterator[EngineOutput]:
        self.prompts.append(tuple(prompt_token_ids))
        return super().generate(request_id, prompt_token_ids, sampling)


def holds(prompt: Sequence[int], segment: Sequence[int]) -> bool:
    """Whether ``segment`` occurs in ``prompt`` as a contiguous run."""
    return any(tuple(prompt[start : start + len(segment)]) == tuple(segment) for start in range(len(prompt)))


async def ask(client: AsyncClient, engine: PromptRecordingEngine) -> tuple[list[str], tuple[int, ...]]:
    """The documents of a serial answer to QUOKKA_QUESTION and the prompt it was answered from."""
    answer = await client.rag(QUOKKA_QUESTION, k=4, mode="serial", max_tokens=2)
    return list(answer.documents), engine.prompts[-1]


async def test_a_put_is_retrieved_a_replacement_prompted_alone_and_a_delete_never_retrieved(
    tiny_assets: Assets, tmp_path: Path
) -> None:
    assets = live_assets(tiny_assets, tmp_path / "log.sqlite")
    assert assets.corpus is not None
    engine = PromptRecordingEngine()
    controller = make_controller(engine, assets)
    app = create_app(controller, corpus=assets.corpus)
    try:
        async with serving(app, access_log=False) as url, AsyncClient(url) as client:
            assert await client.put_document("quokka", QUOKKA_FACT, title="quokka module") == {
                "id": "quokka",
                "version": 1,
            }
            first_row = assets.store.row_of("quokka")
            documents, prompt = await ask(client, engine)
            assert documents[0] == "quokka" and holds(prompt, assets.store.tokens(first_row))

            replaced = "The quokka module now counts marsupials with quokka.tally() instead."
            assert await client.put_document("quokka", replaced, title="quokka module") == {
                "id": "quokka",
                "version": 2,
            }
            second_row = assets.store.row_of("quokka")
            documents, prompt = await ask(client, engine)
            assert documents[0] == "quokka"
            assert holds(prompt, assets.store.tokens(second_row))
            assert not holds(
                prompt, assets.store.tokens(first_row)[2:]
            )  # not even the old text without its label
            assert (await client.get_document("quokka"))["text"] == replaced

            await client.delete_document("quokka")
            documents, _ = await ask(client, engine)
            assert "quokka" not in documents
            with pytest.raises(SpecragHTTPError) as unknown:
                await client.get_document("quokka")
            assert unknown.value.status == 404
            with pytest.raises(SpecragHTTPError) as again:
                await client.delete_document("quokka")
            assert again.value.status == 404
    finally:
        await controller.close()


async def test_changes_need_a_writers_token_when_tokens_are_configured(
    tiny_assets: Assets, tmp_path: Path
) -> None:
    assets = live_assets(tiny_assets, tmp_path / "log.sqlite")
    assert assets.corpus is not None
    controller = make_controller(PromptRecordingEngine(), assets)
    app = create_app(controller, Access(tokens=(TOKEN,), writer_tokens=(WRITER,)), corpus=assets.corpus)
    try:
        async with serving(app, access_log=False) as url:
            async with AsyncClient(url, api_token=TOKEN) as reader:
                with pytest.raises(SpecragHTTPError) as refused:
                    await reader.put_document("doc", "text")
                assert refused.value.status == 403
                with pytest.raises(SpecragHTTPError) as refused:
                    await reader.delete_document(assets.index.passage_ids[0])
                assert refused.value.status == 403
            async with AsyncClient(url, api_token=WRITER) as writer:
                assert (await writer.put_document("doc", "text"))["version"] == 1
            async with AsyncClient(url, api_token=TOKEN) as reader:
                assert (await reader.get_document("doc"))["text"] == "text"
            async with AsyncClient(url) as anonymous:
                with pytest.raises(SpecragHTTPError) as unauthenticated:
                    await anonymous.get_document("doc")
                assert unauthenticated.value.status == 401
    finally:
        await controller.close()


async def test_bad_document_requests_get_their_status(tiny_assets: Assets, tmp_path: Path) -> None:
    assets = live_assets(tiny_assets, tmp_path / "log.sqlite")
    assert assets.corpus is not None
    controller = make_controller(PromptRecordingEngine(), assets)
    app = create_app(controller, corpus=assets.corpus)
    too_many = [{"id": f"d{i}", "title": "", "text": "x"} for i in range(MAX_BATCH_DOCUMENTS + 1)]
    try:
        async with serving(app, access_log=False) as url, aiohttp.ClientSession() as http:
            cases = [
                ("PUT", "/v1/documents/a", {"title": "t"}, 400),  # no text
                ("PUT", "/v1/documents/a", {"text": "x", "colour": "red"}, 400),
                ("PUT", "/v1/documents/a", {"text": 5}, 400),
                ("POST", "/v1/documents", {"documents": []}, 400),
                ("POST", "/v1/documents", {"documents": too_many}, 413),
                (
                    "POST",
                    "/v1/documents",
                    {"documents": [{"id": "a", "text": "x"}, {"id": "a", "text": "y"}]},
                    400,
                ),
                # JSON carries lone surrogates, which neither the tokenizer nor the log can store.
                ("PUT", "/v1/documents/a", {"text": "half of a pair: \ud800"}, 400),
                ("PUT", "/v1/documents/a", {"title": "\udfff", "text": "x"}, 400),
                ("POST", "/v1/documents", {"documents": [{"id": "\ud800", "text": "x"}]}, 400),
                # Ids no URL can name, or told apart by blanks alone.
                ("POST", "/v1/documents", {"documents": [{"id": ".", "text": "x"}]}, 400),
                ("POST", "/v1/documents", {"documents": [{"id": "..", "text": "x"}]}, 400),
                ("PUT", "/v1/documents/%20a", {"text": "x"}, 400),
                ("POST", "/v1/documents", {"documents": [{"id": "a ", "text": "x"}]}, 400),
                ("GET", "/v1/documents/never-was", None, 404),
                ("DELETE", "/v1/documents/never-was", None, 404),
            ]
            for method, path, body, status in cases:
                async with http.request(method, url + path, json=body) as response:
                    assert response.status == status, (method, path, body, await response.text())
                    if status != 204:
                        assert "error" in await response.json()
            async with http.post(
                url + "/v1/documents",
                json={"documents": [{"id": "a", "text": "x"}, {"id": "b", "text": "y"}]},
            ) as response:
                assert response.status == 200
                assert [one["created"] for one in (await response.json())["documents"]] == [True, True]
    finally:
        await controller.close()


async def test_a_conversation_resends_a_document_that_changed_since_it_was_sent(
    tiny_assets: Assets, tmp_path: Path
) -> None:
    assets = live_assets(tiny_assets, tmp_path / "log.sqlite")
    assert assets.corpus is not None
    controller = make_controller(PromptRecordingEngine(), assets)
    try:
        assets.corpus.put([Passage("quokka", "quokka module", QUOKKA_FACT)])
        session_id = controller.create_session("test")
        first = await controller.answer(
            RagRequest(
                QUOKKA_QUESTION, k=4, mode="serial", max_tokens=2, session_id=session_id, client="test"
            )
        )
        assert first.timeline.documents[0] == "quokka"
        assets.corpus.put([Passage("quokka", "quokka module", "The quokka module was renamed wallaby.")])
        second = await controller.answer(
            RagRequest(
                QUOKKA_QUESTION, k=4, mode="serial", max_tokens=2, session_id=session_id, client="test"
            )
        )
        assert "quokka" in second.timeline.documents
        sent_now = second.prompt.token_ids[len(first.prompt.token_ids) :]
        assert holds(sent_now, assets.store.tokens(assets.store.row_of("quokka")))
    finally:
        await controller.close()


async def test_the_documents_command_changes_a_running_service(
    tiny_assets: Assets, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assets = live_assets(tiny_assets, tmp_path / "log.sqlite")
    assert assets.corpus is not None
    controller = make_controller(PromptRecordingEngine(), assets)
    app = create_app(controller, corpus=assets.corpus)
    documents = tmp_path / "new.jsonl"
    documents.write_text(json.dumps({"id": "quokka", "title": "quokka module", "text": QUOKKA_FACT}) + "\n")
    try:
        async with serving(app, access_log=False) as url:
            assert await asyncio.to_thread(main, ["documents", "add", str(documents), "--url", url]) == 0
            assert json.loads(capsys.readouterr().out) == {
                "id": "quokka",
                "version": 1,
                "created": True,
                "visible": True,
            }
            assert assets.corpus.get("quokka").text == QUOKKA_FACT
            assert await asyncio.to_thread(main, ["documents", "delete", "quokka", "--url", url]) == 0
            assert await asyncio.to_thread(main, ["documents", "get", "quokka", "--url", url]) == 2
            assert "404" in capsys.readouterr().err
    finally:
        await controller.close()
