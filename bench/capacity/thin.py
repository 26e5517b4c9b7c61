"""The thin baseline: the cheapest honest RAG front end on specrag's own parts.

One aiohttp handler per question: the question embedded by the same embedder, one one-shot search
of the same index (hybrid where the index is), the prompt built by the same prompt builder in
retrieval order, and the request forwarded to the next replica in turn through the same HTTP
engine adapter, its tokens streamed back as ``/v1/rag`` streams them. No stages, no speculation,
no ordering, no KV mirror, no admission or accounting: what any RAG service has to do at least.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import uuid
from collections.abc import Sequence

from aiohttp import web

from specrag.pipeline.engines.protocol import Engine, Sampling
from specrag.pipeline.store.prompt import PromptBuilder
from specrag.retrieval.vector_index import VectorIndex

__all__ = ["thin_app"]


def _event(name: str, data: dict[str, object]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def thin_app(
    index: VectorIndex, builder: PromptBuilder, engines: Sequence[Engine], k: int
) -> web.Application:
    """``POST /v1/rag`` (``query``, ``k``, ``max_tokens``; always streamed) over ``engines``, in turn."""
    turn = itertools.count()

    async def rag(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        question, top_k = str(body["query"]), int(body.get("k", k))
        loop = asyncio.get_running_loop()
        vector = await loop.run_in_executor(None, index.embed_query, question)
        _, ids = await loop.run_in_executor(None, lambda: index.search(vector, top_k, query_text=question))
        layout = builder.build(index.ranked_rows(ids), question)
        replica = next(turn) % len(engines)
        request_id = "thin-" + uuid.uuid4().hex
        sampling = Sampling(max_tokens=int(body.get("max_tokens", 16)))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        prepared = False
        async for output in engines[replica].generate(request_id, list(layout.token_ids), sampling):
            if not prepared:
                await response.prepare(request)
                prepared = True
            if output.text:
                await response.write(_event("delta", {"text": output.text}))
        await response.write(_event("done", {"request_id": request_id, "replica": replica}))
        return response

    app = web.Application()
    app.router.add_post("/v1/rag", rag)
    return app
