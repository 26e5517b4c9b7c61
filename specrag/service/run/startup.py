"""A service's start: bind first, say what is starting and how long each phase took.

- **Bind first.** The listening socket is bound before anything slow (the artefacts, the
  engine's minute-long start), so a port in use or an address this machine lacks fails within
  a second, and a load balancer or a user's ``curl`` gets an answer from the first second:
  ``/health`` a 503 naming the start-up phase, every other path a 503 with ``Retry-After``
  (:func:`starting_app`). When the service is ready its application takes over the same socket
  (:func:`specrag.service.run.lifecycle.serve_until_signalled`); connections are never refused in
  between, since the socket stays open throughout.
- **Phases with their times.** :class:`StartupProgress` records each phase (artefacts, the
  engine's load, which overlap once the model is verified) as it ends, logs each one's
  duration, and ``/health`` shows them, while starting and once ready, so a slow start says
  where its time went.

How the command runs a service from bind to stop is :mod:`specrag.service.run.lifecycle`'s.
"""

from __future__ import annotations

import enum
import errno
import logging
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import psutil
from aiohttp import web

from specrag.errors import InvalidInputError
from specrag.service.http.wire import ErrorInfo

__all__ = [
    "STARTING_RETRY_AFTER_S",
    "Phase",
    "StartupProgress",
    "bind_listener",
    "starting_app",
]

logger = logging.getLogger(__name__)

# What a client told "starting" should wait before asking again: a start takes tens of seconds.
STARTING_RETRY_AFTER_S = 5.0


class Phase(enum.StrEnum):
    """The steps of a start, in order; ``/health`` names the one running."""

    # corpus, model, document store and index: built if missing, loaded (the engine's load begins
    # once the model is verified, the rest is checked meanwhile)
    ARTEFACTS = "artefacts"
    # vLLM's start, one call into its own processes: the processes, the weights, graph compilation
    # (or its cache), memory profiling and warm-up runs (``-v`` shows vLLM's own split of it).
    ENGINE_LOAD = "engine_load"
    READY = "started"


@dataclass
class StartupProgress:
    """The phases of one start: which runs now, and how long each finished one took.

    ``started_at`` is the command's start (``time.monotonic()``), so that ``ready_s`` is the time a
    user waited. The phases may overlap (``serve`` checks the artefacts other than the model while
    the engine loads), so their durations may add up to more than that.
    """

    started_at: float = field(default_factory=time.monotonic)
    phase: Phase = Phase.ARTEFACTS
    durations_s: dict[Phase, float] = field(default_factory=dict)
    ready_s: float | None = None
    _phase_started: float = field(init=False, default_factory=time.monotonic)

    @classmethod
    def since_process_start(cls) -> StartupProgress:
        """Counted from this process's start: a user waits for the interpreter and imports too."""
        age_s = max(time.time() - psutil.Process().create_time(), 0.0)
        return cls(started_at=time.monotonic() - age_s)

    def begin(self, phase: Phase) -> None:
        self.phase, self._phase_started = phase, time.monotonic()

    def end(self) -> None:
        """The running phase is over: its duration recorded and logged."""
        self.record(self.phase, time.monotonic() - self._phase_started)

    def record(self, phase: Phase, seconds: float) -> None:
        """``phase`` took ``seconds``: kept for ``/health`` and logged."""
        self.durations_s[phase] = seconds
        logger.info("start-up: %s took %.1f s", phase.value.replace("_", " "), seconds)

    def ready(self) -> None:
        self.phase, self.ready_s = Phase.READY, time.monotonic() - self.started_at
        logger.info(
            "start-up: ready after %.1f s (%s)",
            self.ready_s,
            ", ".join(f"{phase.value} {seconds:.1f} s" for phase, seconds in self.durations_s.items()),
        )

    def to_dict(self) -> dict[str, Any]:
        """What ``/health`` shows: the phase, the seconds since the start, each phase's seconds."""
        return {
            "phase": self.phase.value,
            "elapsed_s": round(time.monotonic() - self.started_at, 3),
            "ready_s": None if self.ready_s is None else round(self.ready_s, 3),
            "phases_s": {phase.value: round(seconds, 3) for phase, seconds in self.durations_s.items()},
        }


def bind_listener(host: str, port: int) -> socket.socket:
    """The service's listening socket, bound now: a port in use or an address this machine lacks
    is an :class:`InvalidInputError` naming the flag, before anything slow starts."""
    try:
        family, kind, protocol, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except OSError as error:
        raise InvalidInputError(f"--host {host!r} cannot be bound: {error}") from None
    listener = socket.socket(family, kind, protocol)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp's own sites do
        listener.bind(address)
        listener.listen(128)
    except OSError as error:
        listener.close()
        if error.errno == errno.EADDRINUSE:
            raise InvalidInputError(
                f"--port {port}: {host}:{port} is already in use (another service? --port 0 takes a free one)"
            ) from None
        if error.errno == errno.EADDRNOTAVAIL:
            raise InvalidInputError(f"--host {host!r}: this machine has no such address") from None
        raise InvalidInputError(f"--host {host!r} --port {port} cannot be bound: {error}") from None
    return listener


def starting_app(progress: StartupProgress) -> web.Application:
    """What answers while the service starts: ``/health`` 503 with the phase and its times, every
    other path 503 with ``Retry-After`` (no token needed: it reveals nothing but the phase)."""

    async def answer(request: web.Request) -> web.Response:
        if request.path == "/health":
            body = {
                "status": "starting",
                "reason": f"starting: {progress.phase.value}",
                "startup": progress.to_dict(),
            }
            return web.json_response(body, status=503)
        return ErrorInfo(
            503,
            f"the service is starting ({progress.phase.value.replace('_', ' ')}); retry shortly",
            "service_unavailable",
            "starting",
            STARTING_RETRY_AFTER_S,
        ).response()

    app = web.Application()
    app.router.add_route("*", "/{path:.*}", answer)
    return app
