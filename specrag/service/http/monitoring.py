"""The operator's two endpoints: ``GET /health`` (is it serving, and if not why) and ``GET /metrics``
(what it has counted, in Prometheus' text format).

``/health`` is the one path open without a token (:mod:`specrag.service.http.middleware`), for
load balancers. What the counters are is :mod:`specrag.service.http.metrics`'; what the mirrors
report, :mod:`specrag.service.http.mirror_report`'s; these handlers only answer with them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from specrag.controller.facade import EngineHealth
from specrag.retrieval.backends.shards.shard_actor import ShardState
from specrag.service.http.auth import AUTHENTICATED
from specrag.service.http.documents import CORPUS, documents_health
from specrag.service.http.in_flight import STATE
from specrag.service.http.mirror_report import MIRROR_HEALTH

__all__ = ["INDEX_HEALTH", "SEARCH_SHARDS", "STARTUP", "StartupReport", "health", "metrics_exposition"]


class StartupReport(Protocol):
    """How the service's start went, as ``/health`` shows it
    (:class:`~specrag.service.run.startup.StartupProgress`, set by the command that started it)."""

    def to_dict(self) -> dict[str, Any]: ...


STARTUP = web.AppKey("specrag_startup", StartupReport)

SearchShardsHealth = Callable[[], list[dict[str, Any]]]
SEARCH_SHARDS: web.AppKey[SearchShardsHealth] = web.AppKey("specrag_search_shards")
"""How each search shard actor stands (:func:`specrag.service.run.sharded_serving.shards_health`);
absent: the index is searched in this process."""

IndexHealth = Callable[[], Awaitable[dict[str, Any] | None]]
INDEX_HEALTH: web.AppKey[IndexHealth] = web.AppKey("specrag_index_health")
"""The retrieval backend's part of ``/health``, bounded (a pgvector table's: whether the database
answers); absent or None: the backend has nothing to say. ``"serving": False`` fails every query."""


async def health(request: web.Request) -> web.Response:
    """200 while an engine serves; 503 while it starts, recovers or is gone, while a search
    shard has failed, or while the retrieval backend cannot search (its database does not
    answer), with the reason.

    Without a valid token (when tokens are set) only the status: the engine's last error and the
    replicas' details are for the operator, not for whoever can reach the port."""
    state = request.app[STATE]
    health = await state.core.health()
    shards = request.app[SEARCH_SHARDS]() if SEARCH_SHARDS in request.app else None
    failed = [shard["name"] for shard in shards or () if shard["state"] == ShardState.LOST]
    index = await request.app[INDEX_HEALTH]() if INDEX_HEALTH in request.app else None
    searching = index is None or index["serving"]
    # A failed shard fails every query needing its rows; a backend that cannot search, every query.
    serving = health.serving and not failed and searching
    if state.tokens and not request[AUTHENTICATED]:  # open to load balancers: ready or not, no more
        return web.json_response(
            {"status": "ok" if serving else "unavailable"}, status=200 if serving else 503
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
    if shards is not None:
        replicas["search_shards"] = shards
    if index is not None:
        replicas["index"] = index
    if not serving:
        return web.json_response(
            {"status": "unavailable", "reason": _why_not(health, failed, index), **supervision, **replicas},
            status=503,
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


def _why_not(health: EngineHealth, failed: list[str], index: dict[str, Any] | None) -> str | None:
    """Why the service cannot answer: its engines', else its lost shards', else its index's."""
    if not health.serving:
        return health.reason
    if failed:
        return f"search shard(s) {', '.join(failed)} failed"
    return None if index is None else index.get("reason")


async def metrics_exposition(request: web.Request) -> web.Response:
    return web.Response(
        body=request.app[STATE].metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST}
    )
