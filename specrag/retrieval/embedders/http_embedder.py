"""An embedder behind an OpenAI-compatible ``/v1/embeddings`` endpoint, over aiohttp.

vLLM serving a pooling model (``vllm serve MODEL --task embed``), Hugging Face's Text Embeddings
Inference and most hosted APIs answer ``POST /v1/embeddings`` with ``{"model", "input": [...]}``.
Texts go in batches of ``batch_size``, up to ``max_in_flight`` batches at once, each with its own
timeout; anything but a complete, well-formed answer is an :class:`EmbedderError` naming the
server and what was wrong, never a silently short or misordered matrix.

The :class:`Embedder` interface is synchronous (index builds call it from worker threads), so the
client keeps a private event loop on a daemon thread that owns the aiohttp session;
:meth:`OpenAIEmbedder.embed` submits to it and waits. It must therefore not be called from that
loop itself; from any other thread, the service's event loop included via ``run_in_executor``, it
is safe. A caller that already runs on an event loop (the service embedding a question) awaits
:meth:`OpenAIEmbedder.embed_async` instead: the request is made on that loop with a session of its
own, with no hop to a worker thread and on to the private loop and back, each a GIL hand-over.
"""

from __future__ import annotations

import asyncio
import os
import threading
import weakref
from collections.abc import AsyncGenerator, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable
from urllib.parse import urlsplit

import aiohttp
import numpy as np

from specrag.errors import EmbedderError, EmbedderTimeoutError, InvalidInputError
from specrag.retrieval.arrays import unit_rows

__all__ = [
    "DEFAULT_BATCH_SIZE",
    "DEFAULT_MAX_IN_FLIGHT",
    "DEFAULT_TIMEOUT_S",
    "ENDPOINT",
    "LoopEmbedder",
    "OpenAIEmbedder",
]

ENDPOINT = "/v1/embeddings"
DEFAULT_BATCH_SIZE = 64
DEFAULT_TIMEOUT_S = 30.0
DEFAULT_MAX_IN_FLIGHT = 4
# A probe text for servers whose dimension the caller does not state.
_PROBE = "dimension probe"
_T = TypeVar("_T")


class _LoopThread:
    """An event loop running on its own daemon thread, for sync callers of async code."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="embedder-http", daemon=True)
        self._thread.start()

    def run(self, coroutine: Coroutine[Any, Any, _T]) -> _T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self.loop.close()


@runtime_checkable
class LoopEmbedder(Protocol):
    """An embedder that a caller on an event loop can await there (a server's client)."""

    async def embed_async(self, texts: Sequence[str]) -> np.ndarray: ...


@dataclass(frozen=True)
class _HeldSession:
    session: aiohttp.ClientSession
    keeper: AsyncGenerator[aiohttp.ClientSession, None]


async def _closed_at_shutdown(
    session: aiohttp.ClientSession,
) -> AsyncGenerator[aiohttp.ClientSession, None]:
    """Holds a caller loop's session until that loop shuts its async generators down
    (``asyncio.run`` does, before it closes the loop), then closes it there: the service never
    says when it is done with the embedder, and a session left open warns at exit."""
    try:
        yield session
    finally:
        await session.close()


class OpenAIEmbedder:
    """Embeds through ``{base_url}/v1/embeddings``; the API key, if any, is read from an env var."""

    kind = "openai"

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        dim: int | None = None,
        batch_size: int = DEFAULT_BATCH_SIZE,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
        api_key_env: str | None = None,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise InvalidInputError(f"the embedding server URL must be http(s)://host[:port]: {base_url!r}")
        if not model:
            raise InvalidInputError("name the embedding model the server serves")
        if batch_size < 1 or max_in_flight < 1 or not timeout_s > 0:
            raise InvalidInputError(
                f"batch_size and max_in_flight must be at least 1 and timeout_s positive, got "
                f"{batch_size}, {max_in_flight}, {timeout_s}"
            )
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.batch_size = batch_size
        self.timeout_s = timeout_s
        self.max_in_flight = max_in_flight
        self.api_key_env = api_key_env
        self._headers = {"Content-Type": "application/json"}
        if api_key_env is not None:
            key = os.environ.get(api_key_env)
            if not key:
                raise InvalidInputError(f"the environment variable {api_key_env} (the API key) is not set")
            self._headers["Authorization"] = f"Bearer {key}"
        self._loop = _LoopThread()
        self._sessions: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _HeldSession] = (
            weakref.WeakKeyDictionary()
        )
        """One session per loop that asks (the private one's, and a caller's for embed_async)."""
        self._dim = dim if dim is not None else self._loop.run(self._embed_all([_PROBE])).shape[1]

    @property
    def url(self) -> str:
        return self.base_url + ENDPOINT

    @property
    def dim(self) -> int:
        return self._dim

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Unit vectors of ``texts`` in order; :class:`EmbedderError` if the server fails."""
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        return self._checked(self._loop.run(self._embed_all(list(texts))))

    async def embed_async(self, texts: Sequence[str]) -> np.ndarray:
        """:meth:`embed`, asked on the running loop itself (module doc)."""
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        return self._checked(await self._embed_all(list(texts)))

    def _checked(self, vectors: np.ndarray) -> np.ndarray:
        if vectors.shape[1] != self._dim:
            raise EmbedderError(f"{self.url} returned {vectors.shape[1]} dimensions, expected {self._dim}")
        return unit_rows(vectors)

    async def _session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        held = self._sessions.get(loop)
        if held is None or held.session.closed:
            keeper = _closed_at_shutdown(aiohttp.ClientSession(headers=self._headers))
            held = self._sessions[loop] = _HeldSession(await anext(keeper), keeper)
        return held.session

    async def _embed_all(self, texts: list[str]) -> np.ndarray:
        limit = asyncio.Semaphore(self.max_in_flight)

        async def one(batch: list[str]) -> np.ndarray:
            async with limit:
                return await self._post(batch)

        batches = [texts[i : i + self.batch_size] for i in range(0, len(texts), self.batch_size)]
        parts = await asyncio.gather(*(one(batch) for batch in batches))
        if len({part.shape[1] for part in parts}) > 1:
            raise EmbedderError(f"{self.url} returned vectors of different dimensions across batches")
        return np.concatenate(parts)

    async def _post(self, batch: list[str]) -> np.ndarray:
        body = {"model": self.model, "input": batch, "encoding_format": "float"}
        try:
            async with (await self._session()).post(
                self.url, json=body, timeout=aiohttp.ClientTimeout(total=self.timeout_s)
            ) as response:
                if response.status != 200:
                    detail = (await response.text())[:300]
                    raise EmbedderError(f"{self.url} answered HTTP {response.status}: {detail}")
                payload = await response.json(content_type=None)
        except TimeoutError as error:
            raise EmbedderTimeoutError(
                f"the embedding server {self.url} did not answer within {self.timeout_s:g} s"
            ) from error
        except aiohttp.ClientError as error:
            raise EmbedderError(f"cannot reach the embedding server {self.url}: {error}") from error
        except ValueError as error:  # a body that is not JSON
            raise EmbedderError(f"{self.url} answered with a body that is not JSON: {error}") from error
        return self._vectors_of(payload, len(batch))

    def _vectors_of(self, payload: Any, expected: int) -> np.ndarray:
        """The ``data`` of an answer as a matrix ordered by ``index``, checked item by item."""
        data = payload.get("data") if isinstance(payload, dict) else None
        if not isinstance(data, list) or len(data) != expected:
            got = len(data) if isinstance(data, list) else "no 'data' list"
            raise EmbedderError(f"{self.url} returned {got} embeddings for {expected} inputs")
        rows: dict[int, list[float]] = {}
        for position, item in enumerate(data):
            index = item.get("index", position) if isinstance(item, dict) else None
            vector = item.get("embedding") if isinstance(item, dict) else None
            if not isinstance(index, int) or not 0 <= index < expected or index in rows:
                raise EmbedderError(f"{self.url} returned a bad or repeated 'index' {index!r}")
            if not isinstance(vector, list) or not vector:
                raise EmbedderError(f"{self.url} returned no float 'embedding' for input {index}")
            rows[index] = vector
        try:
            matrix = np.array([rows[i] for i in range(expected)], dtype=np.float32)
        except (TypeError, ValueError) as error:
            raise EmbedderError(
                f"{self.url} returned embeddings that are not float lists of one length"
            ) from error
        if not np.isfinite(matrix).all():
            raise EmbedderError(f"{self.url} returned NaN or infinite values")
        return matrix

    def save(self, directory: Path) -> dict[str, Any]:
        """The server stays where it is: the manifest records how to reach it, never the key."""
        return {
            "kind": self.kind,
            "dim": self.dim,
            "base_url": self.base_url,
            "model": self.model,
            "api_key_env": self.api_key_env,
            "files": [],
        }

    def close(self) -> None:
        """Close the HTTP sessions and stop the loop thread.

        A caller's loop that still runs has its session closed there (without waiting: this may
        be that loop's own thread); one that is closed took its connections with it.
        """
        for loop, held in list(self._sessions.items()):
            session = held.session
            if loop is self._loop.loop:
                self._loop.run(session.close())
            elif loop.is_running():
                asyncio.run_coroutine_threadsafe(session.close(), loop)
            elif not loop.is_closed():
                loop.run_until_complete(session.close())
        self._sessions.clear()
        self._loop.stop()
