"""Who a request counts against, and whether it gets a place among the queries in flight.

The service bounds the queries in flight, all clients together and per client, so that overload
is a 429 with Retry-After and never an unbounded queue. A client is its bearer token when each
client has its own, else its address.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from aiohttp import web

from specrag.controller.facade import QueryCore
from specrag.errors import ECHO_LIMIT, InvalidInputError, OverloadedError
from specrag.service.http.metrics import ServiceMetrics
from specrag.service.http.wire import BodyLimits

__all__ = [
    "CLIENT",
    "STATE",
    "ServiceState",
    "check_query_limits",
    "claim_in_flight",
    "client_key",
    "release_in_flight",
]


@dataclass
class ServiceState:
    """What every handler needs; one per application."""

    core: QueryCore
    metrics: ServiceMetrics
    tokens: tuple[str, ...]
    """The bearer tokens accepted (none: no authentication); token ``i`` is client ``token i+1``."""
    trust_forwarded_for: bool
    model_name: str
    max_queries: int
    max_queries_per_client: int
    limits: BodyLimits
    created: int = field(default_factory=lambda: int(time.time()))
    queries: int = 0
    per_client: dict[str, int] = field(default_factory=dict)


STATE = web.AppKey("specrag_state", ServiceState)
CLIENT = web.RequestKey("specrag_client", str)  # the client a request's token names


def client_key(request: web.Request) -> str:
    """Who a request counts against for the per-client limits: its bearer token when each client
    has its own, else its address: the peer's, or with ``trust_forwarded_for`` the last one in
    ``X-Forwarded-For`` (the address the trusted proxy itself saw; those before it are the
    client's word)."""
    client: str | None = request.get(CLIENT)
    if client is not None:
        return client
    if request.app[STATE].trust_forwarded_for:
        forwarded = request.headers.getall("X-Forwarded-For", [])
        hops = [hop.strip() for header in forwarded for hop in header.split(",") if hop.strip()]
        if hops:
            return hops[-1][:ECHO_LIMIT]
    return request.remote or "unknown"


def check_query_limits(
    max_queries: int,
    max_queries_per_client: int,
    names: tuple[str, str] = ("max_queries", "max_queries_per_client"),
) -> None:
    """The one check of the bounds on queries in flight (at least one each), its error naming them
    as the caller spelled them (``names``): ``serve``'s options check them before any engine starts."""
    if max_queries < 1 or max_queries_per_client < 1:
        raise InvalidInputError(f"{names[0]} and {names[1]} must be at least 1")


def claim_in_flight(state: ServiceState, client: str, mode: str, count: int = 1) -> None:
    """Take ``count`` places among the queries in flight, or :class:`OverloadedError` (counted)."""
    if state.queries + count > state.max_queries:
        state.metrics.count_unfinished(mode, "overloaded", count)
        raise OverloadedError(f"{state.queries} queries in flight, the limit is {state.max_queries}")
    if state.per_client.get(client, 0) + count > state.max_queries_per_client:
        state.metrics.count_unfinished(mode, "overloaded", count)
        raise OverloadedError(
            f"client {client} has {state.per_client.get(client, 0)} queries in flight "
            f"(the limit is {state.max_queries_per_client})"
        )
    state.queries += count
    state.per_client[client] = state.per_client.get(client, 0) + count


def release_in_flight(state: ServiceState, client: str, count: int = 1) -> None:
    state.queries -= count
    state.per_client[client] -= count
    if not state.per_client[client]:
        del state.per_client[client]  # bounded: only clients with queries in flight
