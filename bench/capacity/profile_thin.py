"""The thin RAG front end the profile compares specrag with: the cheapest honest one on the same parts.

An aiohttp handler that embeds the question and searches the same index once (both in the
default executor, off the event loop, as any careful aiohttp service would), builds the prompt in
retrieval order with the same prompt builder, and forwards it to the same engines, round robin,
streaming the answer back as server-sent events. No stages, speculation, ordering, knowledge tree,
metrics or admission control: what specrag adds is what it costs beyond this.
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


def thin_app(index: VectorIndex, builder: PromptBuilder, engines: Sequence[Engine]) -> web.Application:
    """``POST /v1/rag`` (``query``, ``k``, ``max_tokens``) answered as the module doc says."""
    turns = itertools.cycle(engines)

    async def rag(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        question, k = str(body["query"]), int(body.get("k", 6))
        loop = asyncio.get_running_loop()
        vector = await loop.run_in_executor(None, index.embed_query, question)
        _, ids = await loop.run_in_executor(None, lambda: index.search(vector, k, query_text=question))
        layout = builder.build(index.ranked_rows(ids), question)
        sampling = Sampling(max_tokens=int(body.get("max_tokens", 16)))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        started = False
        async for output in next(turns).generate(uuid.uuid4().hex, layout.token_ids, sampling):
            if not started:  # headers with the first token, as specrag sends them
                await response.prepare(request)
                started = True
            await response.write(f"data: {json.dumps({'text': output.text})}\n\n".encode())
        if not started:
            await response.prepare(request)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/rag", rag)
    return app
