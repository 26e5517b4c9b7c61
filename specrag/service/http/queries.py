"""The questions: ``POST /v1/rag`` (specrag's own API), ``POST /v1/rag/batch`` (questions known
together) and ``POST /v1/chat/completions`` (OpenAI's, RAG on the last user message).

- A streamed answer's headers are sent with its first token, not before: every error that can
  happen before the first token (bad k, unknown session, prompt too long, engine failure) still
  gets its proper HTTP status; only a failure after the first token becomes an SSE ``error``.
- A request is checked once, before it takes a place in flight
  (:mod:`specrag.service.http.in_flight`), and the checked request is what runs; bad input gets
  its 4xx even when the service is full.
- When a client goes away its handler is cancelled (:func:`~specrag.service.http.app.serving`),
  the query core's stream is closed, and every engine request of that query (speculations
  included) is aborted instead of burning prefill for nobody.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import AsyncGenerator

from aiohttp import web

from specrag.controller.query import AnswerDelta, AnswerDone, RagRequest
from specrag.errors import ConflictError, EngineError, InvalidInputError, NotFoundError, TooLargeError
from specrag.service.http.bodies import (
    BATCH_FIELDS,
    RAG_FIELDS,
    chat_request,
    check_fields,
    include_usage,
    optional,
    rag_request,
    required,
)
from specrag.service.http.framing import ChatFraming, Framing, RagFraming, rag_body, usage
from specrag.service.http.in_flight import (
    STATE,
    ServiceState,
    claim_in_flight,
    client_key,
    release_in_flight,
)
from specrag.service.http.metrics import mode_label
from specrag.service.http.wire import describe_error, read_json_object

__all__ = ["chat_completions", "rag", "rag_batch"]


async def _answer_events(
    state: ServiceState, request: RagRequest, client: str
) -> AsyncGenerator[AnswerDelta | AnswerDone, None]:
    """The query core's stream with its place among the queries in flight and its accounting;
    closing it aborts the query."""
    request = dataclasses.replace(request, client=client)  # a session answers to its owner only
    try:
        checked = state.core.check(request)  # bad input gets its 4xx even when the service is full
    except (InvalidInputError, NotFoundError, ConflictError):
        state.metrics.count_unfinished(mode_label(request.mode, state.core.default_mode), "rejected")
        raise
    mode = checked.mode.name
    claim_in_flight(state, client, mode)
    outcome = "disconnected"  # what it is when the consumer stops before the end
    try:
        async with contextlib.aclosing(state.core.stream(checked)) as events:
            async for event in events:
                if isinstance(event, AnswerDone):
                    outcome = "ok"
                    state.metrics.observe(event.timeline)
                yield event
    except (InvalidInputError, NotFoundError, ConflictError):
        outcome = "rejected"
        raise
    except Exception:
        outcome = "error"
        raise
    finally:
        release_in_flight(state, client)
        if outcome != "ok":
            state.metrics.count_unfinished(mode, outcome)


async def _collect(state: ServiceState, request: RagRequest, client: str) -> tuple[AnswerDone, int]:
    """The whole answer and its number of generated tokens."""
    tokens = 0
    async with contextlib.aclosing(_answer_events(state, request, client)) as events:
        async for event in events:
            if isinstance(event, AnswerDone):
                return event, tokens
            tokens += len(event.token_ids)
    raise EngineError("the answer stream ended without a result")


async def _stream(
    request: web.Request, state: ServiceState, rag: RagRequest, framing: Framing
) -> web.StreamResponse:
    async with contextlib.aclosing(_answer_events(state, rag, client_key(request))) as events:
        event = await anext(events)  # before the headers: an early error keeps its HTTP status
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        tokens = 0
        try:
            while not isinstance(event, AnswerDone):
                tokens += len(event.token_ids)
                await response.write(framing.delta(event))
                event = await anext(events)
            await response.write(framing.done(event, tokens))
        except ConnectionError:
            pass  # the client left; leaving the block aborts the query
        except Exception as error:
            with contextlib.suppress(ConnectionError):
                await response.write(framing.error(describe_error(error)))
    return response


async def rag(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_json_object(request, state.limits)
    check_fields(body, RAG_FIELDS, "unknown fields")
    rag = rag_request(body, required(body, "query", str), optional(body, "max_tokens", int))
    if optional(body, "stream", bool):
        return await _stream(request, state, rag, RagFraming())
    done, _ = await _collect(state, rag, client_key(request))
    return web.json_response(rag_body(done))


async def rag_batch(request: web.Request) -> web.Response:
    """Questions known together, answered in the order that shares the most prompt prefix
    (:mod:`specrag.controller.batch`); the answers come back in the order asked, with the plan."""
    state, client = request.app[STATE], client_key(request)
    body = await read_json_object(request, state.limits)
    check_fields(body, BATCH_FIELDS, "unknown fields")
    queries = required(body, "queries", list)
    if not all(isinstance(query, str) for query in queries):
        raise InvalidInputError("'queries' must be a list of strings")
    if len(queries) > state.max_queries_per_client:
        raise TooLargeError(f"a batch takes at most {state.max_queries_per_client} questions here")
    rags = [rag_request(body, query, optional(body, "max_tokens", int)) for query in queries]
    mode = mode_label(rags[0].mode if rags else None, state.core.default_mode)
    try:
        checked = state.core.check_batch(rags)
    except InvalidInputError:
        state.metrics.count_unfinished(mode, "rejected", max(len(rags), 1))
        raise
    claim_in_flight(state, client, mode, len(checked))
    outcome = "disconnected"
    try:
        result = await state.core.answer_batch(checked)
        outcome = "ok"
    except Exception:
        outcome = "error"
        raise
    finally:
        release_in_flight(state, client, len(checked))
        if outcome != "ok":
            state.metrics.count_unfinished(mode, outcome, len(checked))
    for done in result.answers:
        state.metrics.observe(done.timeline)
    answers = [
        {"query": query, **rag_body(done)} for query, done in zip(queries, result.answers, strict=True)
    ]
    return web.json_response({"answers": answers, "plan": result.plan.to_dict()})


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """OpenAI chat completions: RAG on the last user message, with docs/service.md's sampling fields."""
    state = request.app[STATE]
    body = await read_json_object(request, state.limits)
    rag = chat_request(body)
    completion_id = f"chatcmpl-{rag.request_id}"
    if optional(body, "stream", bool):
        framing = ChatFraming(completion_id, state.model_name, include_usage(body))
        return await _stream(request, state, rag, framing)
    done, completion_tokens = await _collect(state, rag, client_key(request))
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": done.text},
        "logprobs": None,
        "finish_reason": done.finish_reason or "stop",
    }
    return web.json_response(
        {
            "id": completion_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": state.model_name,
            "choices": [choice],
            "usage": usage(done, completion_tokens),
            "specrag": done.timeline.to_dict(),
        }
    )
