"""Forbid the network inside a test: proof that a model is loaded from local files only."""

from __future__ import annotations

import socket
from typing import Any

import pytest

__all__ = ["NetworkUsed", "forbid_network"]


class NetworkUsed(AssertionError):
    pass


def forbid_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every way to open a connection or resolve a name raises (a download would have to)."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise NetworkUsed(f"network access attempted: {args!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
