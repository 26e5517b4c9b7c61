"""The embedding stand-in (:mod:`specrag.sim.embedding_server`) on a loop thread of its own, for
tests whose embedding client is synchronous (:class:`OpenAIEmbedder` waits on its own thread)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from specrag.sim.embedding_server.server import EmbeddingStandIn, EmbeddingStandInSettings, TextEmbedder

START_TIMEOUT_S = 300.0  # the texts named at start are embedded first


@contextlib.contextmanager
def embedding_stand_in(embedder: TextEmbedder, **settings: Any) -> Iterator[EmbeddingStandIn]:
    """The stand-in serving on a free loopback port while the block runs."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="embedding-stand-in", daemon=True)
    thread.start()
    server = EmbeddingStandIn(EmbeddingStandInSettings(port=0, **settings), embedder)
    try:
        asyncio.run_coroutine_threadsafe(server.__aenter__(), loop).result(timeout=START_TIMEOUT_S)
        yield server
    finally:
        asyncio.run_coroutine_threadsafe(server.__aexit__(None, None, None), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()
