"""The embedding stand-in: the project's MiniLM vectors over OpenAI's /v1/embeddings, texts named
at start embedded before it serves, requests waiting together served in one batch."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import numpy as np
import pytest

from specrag.errors import EmbedderError
from specrag.retrieval.embedders.http_embedder import OpenAIEmbedder
from specrag.retrieval.embedders.served import MINILM_SERVED_NAMES
from specrag.sim.embedding_server.__main__ import parse_settings
from tests.helpers.embedding_server import embedding_stand_in

pytest.importorskip("transformers", reason="MiniLM runs on torch and transformers (the engine's)")

TEXTS = ["how do I rotate the api keys?", "which port does the scheduler listen on", "quokka", "a b c"]


def test_its_vectors_are_the_in_process_embedders(
    minilm_embedder: Any, embedding_clients: list[OpenAIEmbedder]
) -> None:
    with embedding_stand_in(minilm_embedder, precompute=tuple(TEXTS[:2])) as server:
        assert server.stats()["cached_texts"] == 2
        client = OpenAIEmbedder(server.url, MINILM_SERVED_NAMES[0])
        embedding_clients.append(client)
        served = client.embed(TEXTS)
        alone = np.stack([minilm_embedder.embed([text])[0] for text in TEXTS])
        assert client.dim == alone.shape[1] == 384
        np.testing.assert_allclose(served, alone, rtol=0, atol=1e-6)
        stats = server.stats()
        # The dimension probe and the two texts not named at start were computed while serving.
        assert stats["computed_while_serving"] == 3 and stats["cached_texts"] == 5


def test_waiting_requests_share_a_batch_and_bad_ones_are_refused(
    minilm_embedder: Any, embedding_clients: list[OpenAIEmbedder]
) -> None:
    with embedding_stand_in(minilm_embedder, batch_s=0.3, precompute=tuple(TEXTS)) as server:
        client = OpenAIEmbedder(server.url, MINILM_SERVED_NAMES[0], dim=384, batch_size=1, max_in_flight=8)
        embedding_clients.append(client)
        client.embed(TEXTS * 2)  # eight requests at once: the first batch holds one, the next the rest
        assert server.stats()["texts"] == 8 and server.stats()["batches"] < 8
        other = OpenAIEmbedder(server.url, "another-model", dim=384)
        embedding_clients.append(other)
        with pytest.raises(EmbedderError, match=r"HTTP 404.*another-model"):
            other.embed(["x"])

        async def post(body: object) -> int:
            async with (
                aiohttp.ClientSession() as session,
                session.post(f"{server.url}/v1/embeddings", json=body) as response,
            ):
                return response.status

        assert asyncio.run(post({"model": MINILM_SERVED_NAMES[0], "input": []})) == 400
        assert asyncio.run(post({"model": MINILM_SERVED_NAMES[0], "input": [1, 2]})) == 400


def test_the_command_line_refuses_bad_settings(tmp_path: object, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_settings(["--port", "0", "--batch-ms", "-1"])
    assert "batch_s must not be negative" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_settings(["--port", "0", "--precompute", "/nonexistent/texts.json"])
    assert "--precompute" in capsys.readouterr().err
