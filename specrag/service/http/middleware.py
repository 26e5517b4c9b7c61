"""What every request passes through before its handler: the token check, and errors as JSON.

Both are aiohttp middlewares, so no handler repeats them: a handler raises, and the client gets
``{"error": {...}}`` with the proper status (:mod:`specrag.service.http.wire` maps the exception);
``/health`` stays open to load balancers without a token (its handler then says only ready or not).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from specrag.service.http.auth import AUTHENTICATED, matching_token
from specrag.service.http.in_flight import CLIENT, STATE
from specrag.service.http.wire import ErrorInfo, describe_error

__all__ = ["OPEN_PATHS", "Handler", "bearer_tokens", "errors_as_json"]

OPEN_PATHS = frozenset({"/health"})
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def errors_as_json(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as error:
        if error.status < 400:
            raise  # a redirect or success is aiohttp's to send
        return _error_response(request, describe_error(error))
    except Exception as error:
        return _error_response(request, describe_error(error))


def _error_response(request: web.Request, info: ErrorInfo) -> web.Response:
    """The error's response; it closes the connection when the body was refused unread (a
    Content-Length past the limit): aiohttp would otherwise keep reading it for 10 s."""
    response = info.response()
    if not request.content.is_eof():
        response.force_close()
    return response


@web.middleware
async def bearer_tokens(request: web.Request, handler: Handler) -> web.StreamResponse:
    """401 without a configured token; with several tokens, the token names the client."""
    tokens = request.app[STATE].tokens
    if tokens:
        matched = matching_token(request.headers.get("Authorization"), tokens)
        request[AUTHENTICATED] = matched is not None
        if request.path in OPEN_PATHS:
            return await handler(request)
        if matched is None:
            return ErrorInfo(
                401, "missing or wrong bearer token", "authentication_error", "invalid_api_key"
            ).response()
        if len(tokens) > 1:
            request[CLIENT] = f"token {matched + 1}"
    return await handler(request)
