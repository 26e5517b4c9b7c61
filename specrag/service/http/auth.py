"""Who a request is: which configured bearer token it carries, or whether it comes from this machine.

The ``Authorization`` header is the client's bytes: anything may be in it (no scheme, a token
with no scheme, bytes that are not UTF-8, which aiohttp hands on as lone surrogates). Whatever
it holds, the answer is a token's index or None, never an exception: a header that cannot be
read is a wrong token (401), not a server error whose traceback anyone could write to the log.
Every token is compared, in constant time each, so the time taken says nothing of which matched.

Without tokens, "from this machine" (:func:`local_refusal`) takes both ends of the connection:
a loopback peer, and a ``Host`` header naming this service at the port the connection came in on.
The peer alone is not enough: with DNS rebinding a web page in a local browser reaches
127.0.0.1 under its own domain name, which its ``Host`` header still carries.
"""

from __future__ import annotations

import hmac
import ipaddress
from collections.abc import Sequence

from aiohttp import hdrs, web

from specrag.errors import InvalidInputError, echo

__all__ = ["AUTHENTICATED", "LOOPBACK_NAMES", "check_tokens", "local_refusal", "matching_token"]

# The names of this machine's loopback a local client puts in its Host header (URL spelling).
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")

AUTHENTICATED = web.RequestKey("specrag_authenticated", bool)
"""Whether the request carried a configured token (set for every request when tokens are)."""


def check_tokens(tokens: Sequence[str], what: str) -> None:
    """The one check of a set of bearer tokens, wherever it comes from (a file ``serve`` reads, the
    application's :class:`~specrag.service.http.access.Access`): each a non-empty string, none
    twice, since one token for two clients would count them as one. ``what`` names the set as its
    source spells it."""
    if not all(token and isinstance(token, str) for token in tokens):
        raise InvalidInputError(f"{what} holds an empty token")
    if len(set(tokens)) < len(tokens):
        raise InvalidInputError(f"{what} holds a token twice; give each client its own")


def matching_token(header: str | None, tokens: Sequence[str]) -> int | None:
    """The index of the token a ``Bearer`` header carries, or None (missing, malformed or wrong)."""
    scheme, _, provided = (header or "").partition(" ")
    try:
        given = provided.strip().encode("utf-8")
    except UnicodeEncodeError:  # bytes that were not UTF-8 on the wire
        return None
    matches = [hmac.compare_digest(given, token.encode("utf-8")) for token in tokens]
    if scheme.lower() != "bearer" or not any(matches):
        return None
    return matches.index(True)


def local_refusal(request: web.Request, behind_proxy: bool) -> str | None:
    """Why ``request`` is not from this machine to this service, or None when it is: its peer is
    loopback, no proxy forwarded it (``behind_proxy``: the service was told one does, so every
    peer is the proxy), and its ``Host`` is one of :data:`LOOPBACK_NAMES` with the port the
    connection came in on (the socket's, not the header's word)."""
    if not _loopback(request.remote):
        return f"it comes from {request.remote or 'an unknown peer'}, not from this machine"
    if behind_proxy or hdrs.FORWARDED in request.headers or hdrs.X_FORWARDED_FOR in request.headers:
        return "it came through a proxy"
    sockname = request.transport.get_extra_info("sockname") if request.transport is not None else None
    if not isinstance(sockname, tuple) or len(sockname) < 2:
        return "the port it came in on is unknown"
    port = int(sockname[1])
    accepted = {f"{name}:{port}" for name in LOOPBACK_NAMES}
    if port == 80:  # HTTP's default port may go unsaid
        accepted.update(LOOPBACK_NAMES)
    host = request.headers.get(hdrs.HOST, "")
    if host.lower() not in accepted:
        return f"its Host header {echo(host)} does not name this service (localhost:{port})"
    return None


def _loopback(peer: str | None) -> bool:
    """Whether ``peer`` (an address as aiohttp gives it) is a loopback address, IPv4-mapped too."""
    try:
        address = ipaddress.ip_address((peer or "").partition("%")[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback
