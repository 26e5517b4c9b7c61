"""The HTTP application: every route in one table (:data:`ROUTES`), the application made from it
(:func:`create_app`), and serving it (:func:`serving`).

Where each part lives, so a newcomer adds an endpoint in two places (its handler in the module of
its resource, its line in :data:`ROUTES`):

- the resources' handlers: :mod:`~specrag.service.http.queries` (rag, batch, chat),
  :mod:`~specrag.service.http.sessions`, :mod:`~specrag.service.http.models`,
  :mod:`~specrag.service.http.monitoring` (health, metrics), :mod:`~specrag.service.http.documents`;
- what every request passes through: :mod:`~specrag.service.http.middleware` (the token check,
  errors as JSON ``{"error": {"message", "type", "code"}}``, never a stack trace);
  how requests are read off the wire and errors reported, :mod:`~specrag.service.http.wire`;
  which fields a body may hold, :mod:`~specrag.service.http.bodies`; who a request counts against
  and whether it gets a place in flight, :mod:`~specrag.service.http.in_flight`;
- API tokens are compared in constant time (:mod:`~specrag.service.http.auth`). With several
  tokens, one per client, the token tells clients apart (behind a proxy or on one host they share
  an address); without, the peer address does, or the address a trusted proxy says it forwarded
  for.

The only other routes are those of the application that answers while the service starts
(:func:`specrag.service.run.startup.starting_app`: a catch-all 503). The service talks to the
query core only through :class:`~specrag.controller.facade.QueryCore`.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass

from aiohttp import web
from aiohttp.log import access_logger

from specrag.controller.facade import QueryCore
from specrag.errors import InvalidInputError
from specrag.service.http.access import Access
from specrag.service.http.auth import check_tokens
from specrag.service.http.documents import (
    DocumentCorpus,
    attach_corpus,
    delete_document,
    documents_unavailable,
    get_document,
    post_documents,
    put_document,
)
from specrag.service.http.in_flight import STATE, ServiceState, check_query_limits
from specrag.service.http.metrics import ServiceMetrics
from specrag.service.http.middleware import Handler, bearer_tokens, errors_as_json
from specrag.service.http.models import get_model, list_models
from specrag.service.http.monitoring import health, metrics_exposition
from specrag.service.http.queries import chat_completions, rag, rag_batch
from specrag.service.http.redaction import redact_session_ids
from specrag.service.http.sessions import close_session, create_session
from specrag.service.http.wire import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    BodyLimits,
    handler_args,
)

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "ROUTES",
    "SHUTDOWN_GRACE_S",
    "Route",
    "create_app",
    "serving",
]

DEFAULT_MAX_BODY_BYTES = 1 << 20
SHUTDOWN_GRACE_S = 5.0
_OPEN = Access()  # no tokens, the default limits


@dataclass(frozen=True)
class Route:
    """One endpoint: its method, its path and its handler; ``documents`` routes are served only
    when the service has a live corpus."""

    method: str
    path: str
    handler: Handler
    documents: bool = False


ROUTES = (
    Route("GET", "/health", health),
    Route("POST", "/v1/rag", rag),
    Route("POST", "/v1/rag/batch", rag_batch),
    Route("POST", "/v1/chat/completions", chat_completions),
    Route("POST", "/v1/sessions", create_session),
    Route("DELETE", "/v1/sessions/{session_id}", close_session),
    Route("GET", "/v1/models", list_models),
    Route("GET", "/v1/models/{model}", get_model),
    Route("GET", "/metrics", metrics_exposition),
    Route("PUT", "/v1/documents/{document_id}", put_document, documents=True),
    Route("POST", "/v1/documents", post_documents, documents=True),
    Route("GET", "/v1/documents/{document_id}", get_document, documents=True),
    Route("DELETE", "/v1/documents/{document_id}", delete_document, documents=True),
)
"""Every route of the service's application, in the order they are matched."""


def create_app(
    core: QueryCore,
    access: Access = _OPEN,
    *,
    corpus: DocumentCorpus | None = None,
    documents_off: str | None = None,
    model_name: str = "specrag",
    metrics: ServiceMetrics | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
) -> web.Application:
    """The service for one query core (a :class:`~specrag.controller.controller.RagController`).

    ``access`` says who may come in and how many queries each may have in flight: beyond either
    bound the answer is 429 with Retry-After, never an unbounded queue. ``corpus``, a live corpus,
    adds the document routes, which ``access.writer_tokens`` may change; without one,
    ``documents_off`` says why they are off (every document route answers 501 saying it; None:
    the routes are absent). ``header_timeout_s``
    bounds the wait for a request's headers (and an idle keep-alive connection),
    ``body_timeout_s`` the wait for its body.
    """
    check_tokens(access.tokens, "Access.tokens")
    if max_body_bytes < 1:
        raise InvalidInputError("max_body_bytes must be positive")
    check_query_limits(access.max_queries, access.max_queries_per_client)
    if not (header_timeout_s > 0 and body_timeout_s > 0):  # written so that NaN fails too
        raise InvalidInputError("header_timeout_s and body_timeout_s must be positive")
    state = ServiceState(
        core,
        metrics or ServiceMetrics(),
        access.tokens,
        access.trust_forwarded_for,
        model_name,
        access.max_queries,
        access.max_queries_per_client,
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
    if corpus is not None:
        attach_corpus(app, corpus, access.writer_tokens)
    refuse = documents_unavailable(documents_off) if documents_off is not None else None
    for route in ROUTES:
        handler = route.handler if corpus is not None or not route.documents else refuse
        if handler is None:
            continue
        if route.method == "GET":  # and HEAD, as aiohttp's add_get does
            app.router.add_get(route.path, handler)
        else:
            app.router.add_route(route.method, route.path, handler)
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
    session id (:mod:`specrag.service.http.redaction`). ``sock``, a socket already
    listening (:func:`specrag.service.run.startup.bind_listener`), is served instead of binding
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
