"""Who may use the service and how much of it at once, as one object.

``serve``'s flags, a test or a benchmark build one :class:`Access` and hand it, whole, to
:func:`~specrag.service.http.app.create_app` (through
:class:`~specrag.service.run.options.ServiceOptions` on ``serve``'s way), instead of forwarding its
six settings as keywords through every signature between them. It is checked where the
application is made: :func:`~specrag.service.http.auth.check_tokens` for the tokens and
:func:`~specrag.service.http.in_flight.check_query_limits` for the limits.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_MAX_QUERIES", "DEFAULT_MAX_QUERIES_PER_CLIENT", "Access"]

DEFAULT_MAX_QUERIES = 256
DEFAULT_MAX_QUERIES_PER_CLIENT = 64


@dataclass(frozen=True)
class Access:
    """The bearer tokens, how clients are told apart, and the bounds on their queries in flight."""

    tokens: tuple[str, ...] = ()
    """The bearer tokens accepted (none: no authentication). With several, one per client, the
    token tells clients apart; with one or none, the address does."""
    writer_tokens: tuple[str, ...] = ()
    """Tokens that may also change documents (:mod:`specrag.service.http.documents`); accepted only
    when the service has a live corpus."""
    trust_forwarded_for: bool = False
    """Count a request against the address in ``X-Forwarded-For`` (only behind a proxy that sets it)."""
    max_queries: int = DEFAULT_MAX_QUERIES
    """Queries in flight, all clients together: beyond it, 429 with Retry-After."""
    max_queries_per_client: int = DEFAULT_MAX_QUERIES_PER_CLIENT
    """Queries in flight from one client: beyond it, 429 with Retry-After."""
