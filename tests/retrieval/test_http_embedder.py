"""The OpenAI-compatible embedding client against a small aiohttp server on loopback."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
from aiohttp import web

from specrag.errors import EmbedderError, InvalidInputError
from specrag.retrieval.conversational import conversation_query, conversation_query_on_loop
from specrag.retrieval.corpus import Passage
from specrag.retrieval.embedders.embedder import load_embedder
from specrag.retrieval.embedders.http_embedder import LoopEmbedder, OpenAIEmbedder
from specrag.retrieval.embedders.served import ServedEmbedder
from specrag.retrieval.index_store import IndexConfig, build_index, load_index, save_index

DIM = 6


def vector_of(text: str) -> list[float]:
    """A deterministic, text-dependent vector (not unit length: the client normalises)."""
    seed = sum(text.encode("utf-8")) + len(text)
    return list(np.random.default_rng(seed).uniform(0.5, 2.0, DIM).round(4))


class FakeEmbeddingServer:
    """``POST /v1/embeddings`` like vLLM/TEI; ``mode`` switches in one misbehaviour."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []
        self.headers: list[dict[str, str]] = []
        self.mode = "normal"
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/embeddings", self.embeddings)
        self.runner = web.AppRunner(app, shutdown_timeout=1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    async def embeddings(self, request: web.Request) -> web.Response:
        body = await request.json()
        inputs = body["input"]
        self.batches.append(inputs)
        self.headers.append(dict(request.headers))
        if self.mode == "error":
            return web.json_response({"error": {"message": "model overloaded"}}, status=503)
        if self.mode == "hang":
            await asyncio.sleep(5)
        if self.mode == "not-json":
            return web.Response(text="<html>proxy error</html>")
        data: list[dict[str, Any]] = [
            {"object": "embedding", "index": i, "embedding": vector_of(t)} for i, t in enumerate(inputs)
        ]
        if self.mode == "short":
            data = data[:-1]
        if self.mode == "nan":
            data[0]["embedding"][0] = "NaN"
        data.reverse()  # servers may answer out of order: the index field decides
        return web.json_response({"object": "list", "data": data, "model": body["model"]})


@pytest_asyncio.fixture
async def server() -> AsyncIterator[FakeEmbeddingServer]:
    fake = FakeEmbeddingServer()
    await fake.start()
    yield fake
    assert fake.runner is not None
    await fake.runner.cleanup()


async def make(server: FakeEmbeddingServer, **options: Any) -> OpenAIEmbedder:
    """Built in a worker thread: the client's sync calls must not block the server's loop."""
    return await asyncio.to_thread(OpenAIEmbedder, server.url, "fake-embed", **options)


async def test_batches_in_order_and_unit_length(server: FakeEmbeddingServer) -> None:
    embedder = await make(server, batch_size=2)
    assert embedder.dim == DIM  # probed with one request
    texts = [f"text number {i}" for i in range(5)]
    vectors = await asyncio.to_thread(embedder.embed, texts)
    expected = np.array([vector_of(t) for t in texts], dtype=np.float32)
    np.testing.assert_allclose(vectors, expected / np.linalg.norm(expected, axis=1, keepdims=True), rtol=1e-5)
    assert sorted(len(batch) for batch in server.batches[1:]) == [1, 2, 2]
    assert sorted(t for batch in server.batches[1:] for t in batch) == sorted(texts)
    embedder.close()


async def test_embed_async_asks_on_the_callers_loop(
    server: FakeEmbeddingServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    embedder = await make(server, dim=DIM, batch_size=2)
    texts = [f"text number {i}" for i in range(3)]
    expected = await asyncio.to_thread(embedder.embed, texts)

    def no_hop(coroutine: Any) -> None:
        coroutine.close()
        raise AssertionError("embed_async went through the private loop's thread")

    monkeypatch.setattr(embedder._loop, "run", no_hop)
    np.testing.assert_array_equal(await embedder.embed_async(texts), expected)
    served = ServedEmbedder(embedder, {"kind": "minilm", "dim": DIM})  # an index's, as serve has it
    assert isinstance(served, LoopEmbedder)
    np.testing.assert_array_equal(await served.embed_async(texts), expected)
    assert (await embedder.embed_async([])).shape == (0, DIM)
    server.mode = "error"
    with pytest.raises(EmbedderError, match="HTTP 503"):
        await embedder.embed_async(["one"])
    monkeypatch.undo()
    embedder.close()
    await asyncio.sleep(0)  # the caller loop's session closes on that loop


async def test_api_key_comes_from_the_environment(
    server: FakeEmbeddingServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EMBED_KEY", "s3cret")
    embedder = await make(server, dim=DIM, api_key_env="EMBED_KEY")
    await asyncio.to_thread(embedder.embed, ["hello"])
    assert server.headers[-1]["Authorization"] == "Bearer s3cret"
    assert "s3cret" not in json.dumps(embedder.save(Path(".")))
    embedder.close()
    monkeypatch.delenv("EMBED_KEY")
    with pytest.raises(InvalidInputError, match="EMBED_KEY"):
        OpenAIEmbedder(server.url, "fake-embed", dim=DIM, api_key_env="EMBED_KEY")


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("error", "HTTP 503: .*model overloaded"),
        ("hang", "did not answer within 0.3 s"),
        ("not-json", "not JSON"),
        ("short", "returned 1 embeddings for 2 inputs"),
        ("nan", "NaN or infinite"),
    ],
)
async def test_server_failures_are_clear_errors(server: FakeEmbeddingServer, mode: str, message: str) -> None:
    embedder = await make(server, dim=DIM, timeout_s=0.3)
    server.mode = mode
    with pytest.raises(EmbedderError, match=message):
        await asyncio.to_thread(embedder.embed, ["one", "two"])
    embedder.close()


async def test_a_dimension_change_is_an_error(server: FakeEmbeddingServer) -> None:
    embedder = await make(server, dim=DIM + 1)
    with pytest.raises(EmbedderError, match=f"returned {DIM} dimensions, expected {DIM + 1}"):
        await asyncio.to_thread(embedder.embed, ["one"])
    embedder.close()


async def test_unreachable_server_and_bad_settings() -> None:
    with pytest.raises(EmbedderError, match="cannot reach"):
        await asyncio.to_thread(OpenAIEmbedder, "http://127.0.0.1:9", "m", timeout_s=2)
    for url in ("ftp://host", "127.0.0.1:8000", ""):
        with pytest.raises(InvalidInputError, match="URL"):
            OpenAIEmbedder(url, "m", dim=4)
    with pytest.raises(InvalidInputError, match="batch_size"):
        OpenAIEmbedder("http://127.0.0.1:9", "m", dim=4, batch_size=0)


async def test_an_index_built_through_the_server_reloads_it(
    server: FakeEmbeddingServer, passages: list[Passage], tmp_path: Path
) -> None:
    embedder = await make(server, batch_size=16)

    def build_save_load() -> tuple[np.ndarray, np.ndarray]:
        index = build_index(passages, IndexConfig(nlist=4), embedder=embedder)
        save_index(index, tmp_path / "index")
        loaded = load_index(tmp_path / "index")
        query = "asyncio event loop"
        last = list(loaded.search_staged(loaded.embed_query(query), 5, query_text=query))[-1]
        assert isinstance(loaded.embedder, OpenAIEmbedder)
        one_shot = loaded.search(index.embed_query(query), 5, query_text=query)[1]
        loaded.embedder.close()
        return last.ids, one_shot

    staged, one_shot = await asyncio.to_thread(build_save_load)
    np.testing.assert_array_equal(staged, one_shot)
    index = await asyncio.to_thread(load_index, tmp_path / "index")
    for previous in ([], ["What is asyncio?"]):  # a first turn on the loop, a follow-up off it
        on_loop = await conversation_query_on_loop(index, "asyncio event loop", previous)
        in_thread = await asyncio.to_thread(conversation_query, index, "asyncio event loop", previous)
        np.testing.assert_array_equal(on_loop.vector, in_thread.vector)
        assert (on_loop.text, on_loop.joined) == (in_thread.text, in_thread.joined)
    assert isinstance(index.embedder, OpenAIEmbedder)
    index.embedder.close()
    reloaded = load_embedder(tmp_path / "index", embedder.save(tmp_path))
    assert isinstance(reloaded, OpenAIEmbedder) and (reloaded.url, reloaded.dim) == (embedder.url, DIM)
    reloaded.close()
    embedder.close()
