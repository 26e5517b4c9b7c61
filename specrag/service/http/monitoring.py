"""The operator's two endpoints: ``GET /health`` (is it serving, and if not why) and ``GET /metrics``
(what it has counted, in Prometheus' text format).

``/health`` is the one path open without a token (:mod:`specrag.service.http.middleware`), for
load balancers. What the counters are is :mod:`specrag.service.http.metrics`'; what the mirrors
report, :mod:`specrag.service.http.mirror_report`'s; these handlers only answer with them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from specrag.retrieval.backends.shards.shard_actor import ShardState
from specrag.service.http.auth import AUTHENTICATED
from specrag.service.http.documents import CORPUS, documents_health
from specrag.service.http.in_flight import STATE
from specrag.service.http.mirror_report import MIRROR_HEALTH

__all__ = ["SEARCH_SHARDS", "STARTUP", "StartupReport", "health", "metrics_exposition"]


class StartupReport(Protocol):
    """How the service's start went, as ``/health`` shows it
    (:class:`~specrag.service.run.startup.StartupProgress`, set by the command that started it)."""

    def to_dict(self) -> dict[str, Any]: ...


STARTUP = web.AppKey("specrag_startup", StartupReport)

SearchShardsHealth = Callable[[], list[dict[str, Any]]]
SEARCH_SHARDS: web.AppKey[SearchShardsHealth] = web.AppKey("specrag_search_shards")
"""How each search shard actor stands (:func:`specrag.service.run.sharded_serving.shards_health`);
absent: the index is searched in this process."""


async def health(request: web.Request) -> web.Response:
    """200 while an engine serves; 503 while it starts, recovers or is gone, or while a search
    shard has failed (with the reason).

    Without a valid token (when tokens are set) only the status: the engine's last error and the
    replicas' details are for the operator, not for whoever can reach the port."""
    state = request.app[STATE]
    health = await state.core.health()
    shards = request.app[SEARCH_SHARDS]() if SEARCH_SHARDS in request.app else None
    failed = [shard["name"] for shard in shards or () if shard["state"] == ShardState.LOST]
    serving = health.serving and not failed  # a failed shard fails every query needing its rows
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
    if not serving:
        reason = health.reason if not health.serving else f"search shard(s) {', '.join(failed)} failed"
        return web.json_response(
            {"status": "unavailable", "reason": reason, **supervision, **replicas}, status=503
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


async def metrics_exposition(request: web.Request) -> web.Response:
    return web.Response(
        body=request.app[STATE].metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST}
    )
