"""``POST /v1/sessions`` and ``DELETE /v1/sessions/{session_id}``: a conversation's session, owned by
the client that opened it (:func:`~specrag.service.http.in_flight.client_key`), which alone may
use or close it."""

from __future__ import annotations

from aiohttp import web

from specrag.service.http.in_flight import STATE, client_key

__all__ = ["close_session", "create_session"]


async def create_session(request: web.Request) -> web.Response:
    session_id = request.app[STATE].core.create_session(client_key(request))
    return web.json_response({"session_id": session_id}, status=201)


async def close_session(request: web.Request) -> web.Response:
    request.app[STATE].core.close_session(request.match_info["session_id"], client_key(request))
    return web.Response(status=204)
