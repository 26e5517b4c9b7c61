"""``GET /v1/models`` and ``GET /v1/models/{model}``: OpenAI's model list, holding the one model this
service answers with (OpenAI clients discover it here)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from specrag.errors import NotFoundError, echo
from specrag.service.http.in_flight import STATE, ServiceState

__all__ = ["get_model", "list_models"]


def _model_card(state: ServiceState) -> dict[str, Any]:
    return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "specrag"}


async def list_models(request: web.Request) -> web.Response:
    """OpenAI's model list: the one model this service answers with (clients discover it here)."""
    return web.json_response({"object": "list", "data": [_model_card(request.app[STATE])]})


async def get_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    name = request.match_info["model"]
    if name != state.model_name:
        raise NotFoundError(f"unknown model {echo(name)}; this service serves {state.model_name!r}")
    return web.json_response(_model_card(state))
