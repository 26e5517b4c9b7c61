"""Who can reach the service: a warning when it listens beyond loopback with no token.

Without a token, anyone who reaches the port can query, open sessions (whose per-client bound and
ownership then go by address) and read ``/metrics``. On loopback that is the machine's users; on
any other address it is the network, which an operator should hear about at start, not find out.
Document writes are not the network's even then: without a writer's token they are taken only
from this machine (:mod:`specrag.service.http.documents`), which the warning says, so that an operator
who meant to change documents from elsewhere learns at start what to configure.
"""

from __future__ import annotations

import ipaddress
import logging
import socket

__all__ = ["beyond_loopback", "warn_if_exposed"]

logger = logging.getLogger(__name__)


def beyond_loopback(host: str) -> bool:
    """Whether binding ``host`` listens on an address other than loopback (every interface does)."""
    try:
        infos = socket.getaddrinfo(host or None, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return True  # unknown: assume the worse
    addresses = {str(info[4][0]).partition("%")[0] for info in infos}
    return not all(ipaddress.ip_address(address).is_loopback for address in addresses)


def warn_if_exposed(host: str, has_token: bool) -> bool:
    """Log a WARNING (and say True) when ``host`` is beyond loopback and no token is required."""
    if has_token or not beyond_loopback(host):
        return False
    logger.warning(
        "serving on %s without an API token: anyone who can reach this port can query, open "
        "sessions and read /metrics; set --api-token-env or --api-tokens-file, or serve on 127.0.0.1. "
        "Document writes (PUT, POST, DELETE /v1/documents) are refused except from this machine; "
        "set --writer-tokens-file to allow them from elsewhere",
        host or "every interface",
    )
    return True
