"""The embedding stand-in's HTTP face and its batches, on 127.0.0.1 only.

- ``POST /v1/embeddings`` with ``{"model", "input": str | [str, ...]}``: OpenAI's answer shape
  (``data`` items with ``index`` and ``embedding``, ``model``, ``usage``); another model name is
  a 404 and a malformed body a 400, in OpenAI's error shape.
- ``GET /health``; ``GET /standin/stats``: the batches served, the texts embedded, and how many of
  those had to be computed while serving (not embedded at start): a benchmark's check that the
  stand-in spent no CPU on the model while it measured.

Requests wait in one queue; a batch takes every text waiting (up to ``max_batch_texts``), lasts
``batch_s`` and answers them together, as a GPU server's dynamic batching does.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Protocol

import numpy as np
from aiohttp import web

from specrag.errors import InvalidInputError
from specrag.retrieval.embedders.served import MINILM_SERVED_NAMES

__all__ = ["HOST", "EmbeddingStandIn", "EmbeddingStandInSettings", "TextEmbedder"]

HOST = "127.0.0.1"


class TextEmbedder(Protocol):
    def embed(self, texts: Sequence[str]) -> np.ndarray: ...


@dataclass(frozen=True)
class EmbeddingStandInSettings:
    """The port, the model name it answers to, a batch's time, and the texts embedded at start."""

    port: int
    model: str = MINILM_SERVED_NAMES[0]
    #: Seconds one batch takes, whatever its size (docs/capacity.md derives it for MiniLM on a GPU).
    batch_s: float = 0.001
    max_batch_texts: int = 256
    precompute: tuple[str, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise InvalidInputError(f"embedding stand-in: the port must be within 0..65535, got {self.port}")
        if self.batch_s < 0 or self.max_batch_texts < 1:
            raise InvalidInputError(
                f"embedding stand-in: batch_s must not be negative and max_batch_texts at least 1, got "
                f"{self.batch_s} and {self.max_batch_texts}"
            )


@dataclass
class _Pending:
    texts: list[str]
    answer: asyncio.Future[list[list[float]]]


@dataclass
class _Stats:
    batches: int = 0
    texts: int = 0
    computed_while_serving: int = 0


def _error(status: int, message: str, kind: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


class EmbeddingStandIn:
    """The server while ``async with`` runs: vectors by text, served in timed batches."""

    def __init__(self, settings: EmbeddingStandInSettings, embedder: TextEmbedder) -> None:
        self.settings = settings
        self._embedder = embedder
        self._vectors: dict[str, list[float]] = {}
        self._waiting: deque[_Pending] = deque()
        self._arrived = asyncio.Event()
        self._stats = _Stats()
        self._runner: web.AppRunner | None = None
        self._batcher: asyncio.Task[None] | None = None
        self.port = settings.port

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    async def __aenter__(self) -> EmbeddingStandIn:
        await asyncio.to_thread(self._embed_alone, list(dict.fromkeys(self.settings.precompute)))
        app = web.Application()
        app.router.add_post("/v1/embeddings", self._embeddings)
        app.router.add_get("/health", _health)
        app.router.add_get("/standin/stats", self._stats_response)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, HOST, self.settings.port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._batcher = asyncio.create_task(self._serve_batches())
        return self

    async def __aexit__(self, *_: object) -> None:
        if self._batcher is not None:
            self._batcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._batcher
        if self._runner is not None:
            await self._runner.cleanup()

    def _embed_alone(self, texts: list[str]) -> None:
        """Each text's vector, computed alone: a batch's padding would change it in the last bits."""
        for text in texts:
            if text not in self._vectors:
                self._vectors[text] = [float(x) for x in self._embedder.embed([text])[0]]

    async def _embeddings(self, http: web.Request) -> web.Response:
        try:
            body = await http.json()
        except ValueError:
            return _error(400, "the body is not JSON", "invalid_request_error")
        inputs = body.get("input") if isinstance(body, dict) else None
        texts = [inputs] if isinstance(inputs, str) else inputs
        if not isinstance(texts, list) or not texts or not all(isinstance(text, str) for text in texts):
            message = "'input' must be a string or a non-empty list of strings"
            return _error(400, message, "invalid_request_error")
        if body.get("model") != self.settings.model:
            return _error(404, f"the model {body.get('model')!r} does not exist", "NotFoundError")
        pending = _Pending(texts, asyncio.get_running_loop().create_future())
        self._waiting.append(pending)
        self._arrived.set()
        vectors = await pending.answer
        data = [{"object": "embedding", "index": i, "embedding": vector} for i, vector in enumerate(vectors)]
        usage = {"prompt_tokens": 0, "total_tokens": 0}
        answer = {"object": "list", "data": data, "model": self.settings.model, "usage": usage}
        return web.json_response(answer)

    def stats(self) -> dict[str, int]:
        """Batches served, texts embedded, those computed while serving, texts held."""
        return {**asdict(self._stats), "cached_texts": len(self._vectors)}

    async def _stats_response(self, _: web.Request) -> web.Response:
        return web.json_response(self.stats())

    async def _serve_batches(self) -> None:
        while True:
            await self._arrived.wait()
            self._arrived.clear()
            while self._waiting:
                batch = [self._waiting.popleft()]
                size = len(batch[0].texts)
                while self._waiting and size + len(self._waiting[0].texts) <= self.settings.max_batch_texts:
                    batch.append(self._waiting.popleft())
                    size += len(batch[-1].texts)
                await self._answer(batch)

    async def _answer(self, batch: list[_Pending]) -> None:
        """One batch: its time, then its vectors (any not embedded at start computed now)."""
        await asyncio.sleep(self.settings.batch_s)
        texts = [text for pending in batch for text in pending.texts]
        missing = [text for text in dict.fromkeys(texts) if text not in self._vectors]
        if missing:
            self._stats.computed_while_serving += len(missing)
            await asyncio.to_thread(self._embed_alone, missing)
        self._stats.batches += 1
        self._stats.texts += len(texts)
        for pending in batch:
            if not pending.answer.done():  # a client that left cancelled its wait
                pending.answer.set_result([self._vectors[text] for text in pending.texts])


async def _health(_: web.Request) -> web.Response:
    return web.Response()
