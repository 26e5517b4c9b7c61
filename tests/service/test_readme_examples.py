"""The README's first queries (curl, specrag's client, the OpenAI client), run as pasted against
the service on real vLLM: a reader's first contact must work, and a changed field name or default
URL that the README still shows fails here. Only the address is swapped for the test service's."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from specrag.pipeline.engines.vllm_engine import VllmEngine
from specrag.service.run.assets import Assets
from tests.helpers.builders import make_controller
from tests.helpers.http import running

pytestmark = pytest.mark.engine

README = Path(__file__).resolve().parents[2] / "README.md"
README_URL = "http://127.0.0.1:8080"
_BLOCK = re.compile(r"^```(\w+)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def readme_blocks(language: str, containing: str) -> list[str]:
    """The README's fenced ``language`` blocks that mention ``containing``."""
    blocks = [code for lang, code in _BLOCK.findall(README.read_text()) if lang == language]
    return [code for code in blocks if containing in code]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def url(vllm_engine: VllmEngine, tiny_assets: Assets) -> AsyncIterator[str]:
    async with running(make_controller(vllm_engine, tiny_assets)) as address:
        yield address


async def run(url: str, *command: str) -> str:
    """A command with the README's address replaced by the service's; its stdout (exit status 0)."""
    process = await asyncio.create_subprocess_exec(
        *(part.replace(README_URL, url) for part in command),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=README.parent,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=120)
    assert process.returncode == 0, stderr.decode()
    return stdout.decode()


def json_objects(text: str) -> list[Any]:
    """The JSON values printed one after the other (curl adds no newline between them)."""
    decoder, values, position = json.JSONDecoder(), [], 0
    while position < len(text.strip()):
        value, position = decoder.raw_decode(text, position)
        values.append(value)
        while position < len(text) and text[position].isspace():
            position += 1
    return values


async def test_the_curl_examples(url: str) -> None:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    (block,) = readme_blocks("bash", "curl ")
    rag, chat = json_objects(await run(url, "bash", "-ec", block))
    assert isinstance(rag["answer"], str) and rag["specrag"]["cached_prompt_tokens"] >= 0
    assert len(rag["documents"]) == 4
    assert (
        chat["object"] == "chat.completion" and chat["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0
    )


async def test_the_python_client_example_prints_the_answer_then_the_cached_tokens(url: str) -> None:
    (code,) = readme_blocks("python", "from specrag import AsyncClient")
    lines = (await run(url, sys.executable, "-c", code)).splitlines()
    assert len(lines) >= 2 and int(lines[-1]) >= 0


async def test_the_openai_client_example(url: str) -> None:
    pytest.importorskip("openai")
    (code,) = readme_blocks("python", "from openai import OpenAI")
    lines = (await run(url, sys.executable, "-c", code)).splitlines()
    assert len(lines) >= 2 and int(lines[-1]) >= 0
