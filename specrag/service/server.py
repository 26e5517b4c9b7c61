"""The HTTP service: specrag's own RAG API, an OpenAI-compatible chat endpoint, sessions, metrics.

Design points, each for a reason:

- A streamed answer's headers are sent with its first token, not before: every error that can
  happen before the first token (bad k, unknown session, prompt too long, engine failure) still
  gets its proper HTTP status; only a failure after the first token becomes an SSE ``error``.
- The service runs with aiohttp's handler cancellation (:func:`serving`): when a client goes away,
  its handler is cancelled, the controller's stream is closed, and every engine request of that
  query (speculations included) is aborted instead of burning prefill for nobody.
- Errors are JSON ``{"error": {"message", "type", "code"}}``; an unexpected exception is logged
  here and answered with a generic 500, never a stack trace. How requests are read off the wire
  (bodies, JSON, timeouts, what the HTTP parser rejects) and how an error is reported is
  :mod:`specrag.service.wire`'s; which fields a body may hold, :mod:`specrag.service.bodies`'.
- API tokens are compared in constant time (:mod:`specrag.service.auth`, checked by
  :mod:`specrag.service.middleware`); ``/health`` stays open
  for load balancers, and says only ready or not to a request without a valid token. With
  several tokens, one per client, the token tells clients apart (behind a proxy or on one host
  they share an address); without, the peer address does, or the address a trusted proxy says
  it forwarded for. Per-client limits (queries in flight, sessions) count by that key
  (:mod:`specrag.service.admission`).
- The service talks to the query core only through :class:`~specrag.controller.facade.QueryCore`
  (answer, load, health, sessions); a request is checked once, before it takes a place in flight,
  and the checked request is what runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import socket
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

from aiohttp import web
from aiohttp.log import access_logger
from prometheus_client import CONTENT_TYPE_LATEST

from specrag.controller.facade import QueryCore
from specrag.controller.query import AnswerDelta, AnswerDone, RagRequest
from specrag.errors import (
    ConflictError,
    EngineError,
    InvalidInputError,
    NotFoundError,
    TooLargeError,
    echo,
)
from specrag.service.admission import (
    STATE,
    ServiceState,
    check_query_limits,
    claim_in_flight,
    client_key,
    release_in_flight,
)
from specrag.service.auth import AUTHENTICATED
from specrag.service.bodies import (
    BATCH_FIELDS,
    RAG_FIELDS,
    chat_request,
    check_fields,
    include_usage,
    optional,
    rag_request,
    required,
)
from specrag.service.documents import CORPUS, documents_health
from specrag.service.framing import ChatFraming, Framing, RagFraming, rag_body, usage
from specrag.service.metrics import ServiceMetrics, mode_label
from specrag.service.middleware import bearer_tokens, errors_as_json
from specrag.service.mirror_report import MIRROR_HEALTH
from specrag.service.redaction import redact_session_ids
from specrag.service.startup import STARTUP
from specrag.service.wire import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    BodyLimits,
    describe_error,
    handler_args,
    parse_json_object,
    read_body,
)

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_QUERIES",
    "DEFAULT_MAX_QUERIES_PER_CLIENT",
    "SHUTDOWN_GRACE_S",
    "create_app",
    "serving",
]

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_MAX_QUERIES = 256
DEFAULT_MAX_QUERIES_PER_CLIENT = 64
SHUTDOWN_GRACE_S = 5.0


# ---------------------------------------------------------------------------------------- input


async def _json_object(request: web.Request) -> dict[str, Any]:
    if request.content_type != "application/json":
        raise web.HTTPUnsupportedMediaType(text="the body must be JSON (Content-Type: application/json)")
    return parse_json_object(await read_body(request, request.app[STATE].limits))


# ---------------------------------------------------------------------------------------- queries


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


# ---------------------------------------------------------------------------------------- handlers


async def _health(request: web.Request) -> web.Response:
    """200 while an engine serves; 503 while it starts, recovers or is gone (with the reason).

    Without a valid token (when tokens are set) only the status: the engine's last error and the
    replicas' details are for the operator, not for whoever can reach the port."""
    state = request.app[STATE]
    health = await state.core.health()
    if state.tokens and not request[AUTHENTICATED]:  # open to load balancers: ready or not, no more
        return web.json_response(
            {"status": "ok" if health.serving else "unavailable"}, status=200 if health.serving else 503
        )
    status = health.supervision
    supervision = (
        {
            "engine_state": status.state,
            "engine_restarts": status.restarts,
            "last_recovery_s": status.last_recovery_s,
        }
        if status is not None
        else {}
    )
    mirrors = request.app[MIRROR_HEALTH]() if MIRROR_HEALTH in request.app else {}
    replicas: dict[str, Any] = {
        "replicas": [
            {**dataclasses.asdict(facts), **mirrors.get(facts.name, {})} for facts in health.replicas
        ]
    }
    if (startup := request.app.get(STARTUP)) is not None:
        replicas["startup"] = startup.to_dict()  # how long each start-up phase took
    if CORPUS in request.app:
        replicas.update(documents_health(request.app))
    if not health.serving:
        return web.json_response(
            {"status": "unavailable", "reason": health.reason, **supervision, **replicas}, status=503
        )
    load = state.core.load()
    return web.json_response(
        {
            "status": "ok",
            "model": state.model_name,
            "in_flight_queries": state.queries,
            "prefill_pool": load.prefill_pool,
            "queued": load.queued,
            **supervision,
            **replicas,
        }
    )


async def _rag(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body = await _json_object(request)
    check_fields(body, RAG_FIELDS, "unknown fields")
    rag = rag_request(body, required(body, "query", str), optional(body, "max_tokens", int))
    if optional(body, "stream", bool):
        return await _stream(request, state, rag, RagFraming())
    done, _ = await _collect(state, rag, client_key(request))
    return web.json_response(rag_body(done))


async def _rag_batch(request: web.Request) -> web.Response:
    """Questions known together, answered in the order that shares the most prompt prefix
    (:mod:`specrag.controller.batch`); the answers come back in the order asked, with the plan."""
    state, client = request.app[STATE], client_key(request)
    body = await _json_object(request)
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


async def _chat(request: web.Request) -> web.StreamResponse:
    """OpenAI chat completions: RAG on the last user message, with docs/service.md's sampling fields."""
    state = request.app[STATE]
    body = await _json_object(request)
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


async def _create_session(request: web.Request) -> web.Response:
    session_id = request.app[STATE].core.create_session(client_key(request))
    return web.json_response({"session_id": session_id}, status=201)


def _model_card(state: ServiceState) -> dict[str, Any]:
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "specrag"}


async def _models(request: web.Request) -> web.Response:
    """OpenAI's model list: the one model this service answers with (clients discover it here)."""
    return web.json_response({"object": "list", "data": [_model_card(request.app[STATE])]})


async def _model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    name = request.match_info["model"]
    if name != state.model_name:
        raise NotFoundError(f"unknown model {echo(name)}; this service serves {state.model_name!r}")
    return web.json_response(_model_card(state))


async def _close_session(request: web.Request) -> web.Response:
    request.app[STATE].core.close_session(request.match_info["session_id"], client_key(request))
    return web.Response(status=204)


async def _metrics(request: web.Request) -> web.Response:
    return web.Response(
        body=request.app[STATE].metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST}
    )


def create_app(
    core: QueryCore,
    *,
    api_token: str | None = None,
    api_tokens: Sequence[str] = (),
    trust_forwarded_for: bool = False,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    model_name: str = "specrag",
    max_queries: int = DEFAULT_MAX_QUERIES,
    max_queries_per_client: int = DEFAULT_MAX_QUERIES_PER_CLIENT,
    metrics: ServiceMetrics | None = None,
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
) -> web.Application:
    """The service for one query core (a :class:`~specrag.controller.controller.RagController`).

    ``api_token`` or ``api_tokens`` (several: one per client, the token then telling clients
    apart) are the bearer tokens accepted; none, no authentication. ``trust_forwarded_for``
    counts a request against the address in ``X-Forwarded-For`` (only behind a proxy that sets
    it). ``max_queries`` bounds concurrent queries, ``max_queries_per_client`` those of one
    client: beyond either the answer is 429 with Retry-After, never an unbounded queue.
    ``header_timeout_s`` bounds the wait for a request's headers (and an idle keep-alive
    connection), ``body_timeout_s`` the wait for its body.
    """
    if api_token is not None and not api_token:
        raise InvalidInputError("the API token must not be empty (pass None to disable it)")
    tokens = (*([api_token] if api_token is not None else []), *api_tokens)
    if not all(token and isinstance(token, str) for token in tokens) or len(set(tokens)) < len(tokens):
        raise InvalidInputError("the API tokens must be non-empty strings, each given once")
    if max_body_bytes < 1:
        raise InvalidInputError("max_body_bytes must be positive")
    check_query_limits(max_queries, max_queries_per_client)
    if not (header_timeout_s > 0 and body_timeout_s > 0):  # written so that NaN fails too
        raise InvalidInputError("header_timeout_s and body_timeout_s must be positive")
    state = ServiceState(
        core,
        metrics or ServiceMetrics(),
        tokens,
        trust_forwarded_for,
        model_name,
        max_queries,
        max_queries_per_client,
        BodyLimits(max_body_bytes, body_timeout_s),
    )
    state.metrics.watch(
        prefill_pool=lambda: core.load().prefill_pool,
        queued=lambda: core.load().queued,
        in_flight=lambda: state.queries,
        warmups=lambda: core.warmups,
    )
    app = web.Application(
        middlewares=[errors_as_json, bearer_tokens],
        client_max_size=max_body_bytes,
        handler_args=handler_args(header_timeout_s),
    )
    app[STATE] = state
    app.router.add_get("/health", _health)
    app.router.add_post("/v1/rag", _rag)
    app.router.add_post("/v1/rag/batch", _rag_batch)
    app.router.add_post("/v1/chat/completions", _chat)
    app.router.add_post("/v1/sessions", _create_session)
    app.router.add_delete("/v1/sessions/{session_id}", _close_session)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/v1/models/{model}", _model)
    app.router.add_get("/metrics", _metrics)
    return app


@contextlib.asynccontextmanager
async def serving(
    app: web.Application,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    access_log: bool = True,
    sock: socket.socket | None = None,
    shutdown_timeout_s: float = SHUTDOWN_GRACE_S,
) -> AsyncIterator[str]:
    """Serve ``app`` for the duration of the block; yields its base URL (the real port if ``port=0``).

    Handler cancellation is on so a client that disconnects aborts its query's engine requests.
    ``access_log=False`` keeps a terminal demo's output readable; the access log never shows a
    session id (:mod:`specrag.service.redaction`). ``sock``, a socket already
    listening (``specrag.service.lifecycle.bind_listener``), is served instead of binding
    ``host``/``port``; it stays the caller's, open after the block. On exit, answers in flight
    get ``shutdown_timeout_s`` to finish before they are cancelled (their queries aborted).
    """
    redact_session_ids(access_logger)
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        shutdown_timeout=shutdown_timeout_s,
        access_log=access_logger if access_log else None,
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port) if sock is None else web.SockSite(runner, sock.dup())
        await site.start()
        bound_port = runner.addresses[0][1]
        host = host if sock is None else str(sock.getsockname()[0])
        yield f"http://[{host}]:{bound_port}" if ":" in host else f"http://{host}:{bound_port}"
    finally:
        await runner.cleanup()
