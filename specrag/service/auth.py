"""Bearer tokens: which configured token a request carries, decided once per request.

The ``Authorization`` header is the client's bytes: anything may be in it (no scheme, a token
with no scheme, bytes that are not UTF-8, which aiohttp hands on as lone surrogates). Whatever
it holds, the answer is a token's index or None, never an exception: a header that cannot be
read is a wrong token (401), not a server error whose traceback anyone could write to the log.
Every token is compared, in constant time each, so the time taken says nothing of which matched.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence

from aiohttp import web

__all__ = ["AUTHENTICATED", "matching_token"]

AUTHENTICATED = web.RequestKey("specrag_authenticated", bool)
"""Whether the request carried a configured token (set for every request when tokens are)."""


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
