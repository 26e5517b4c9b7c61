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

- **A bound on every phase.** Each phase has a time bound (``serve --startup-timeout
  PHASE=SECONDS``, :data:`DEFAULT_BOUNDS_S`); a phase that outlives it ends the start with a
  :class:`StartupTimeoutError` naming the phase, its bound, what it waited for and the flag
  (:meth:`StartupProgress.overdue`, enforced by :mod:`specrag.service.run.lifecycle`), never an
  endless ``starting``.

How the command runs a service from bind to stop is :mod:`specrag.service.run.lifecycle`'s.
"""

from __future__ import annotations

import enum
import errno
import logging
import math
import socket
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import psutil
from aiohttp import web

from specrag.errors import InvalidInputError, SpecragError
from specrag.service.http.wire import ErrorInfo

__all__ = [
    "DEFAULT_BOUNDS_S",
    "STARTING_RETRY_AFTER_S",
    "Phase",
    "StartupProgress",
    "StartupTimeoutError",
    "bind_listener",
    "parse_bounds",
    "starting_app",
]

logger = logging.getLogger(__name__)

# What a client told "starting" should wait before asking again: a start takes tens of seconds.
STARTING_RETRY_AFTER_S = 5.0


class Phase(enum.StrEnum):
    """The steps of a start, in order; ``/health`` names the one running."""

    # torch, transformers, vLLM, the embedder's libraries: imported once, on one thread, before
    # the artefact checks and the engine's start run side by side (specrag.service.run.imports)
    IMPORTS = "imports"
    # corpus, model, document store and index: built if missing, loaded (the engine's load begins
    # once the model is verified, the rest is checked meanwhile)
    ARTEFACTS = "artefacts"
    # vLLM's start, one call into its own processes: the processes, the weights, graph compilation
    # (or its cache), memory profiling and warm-up runs (``-v`` shows vLLM's own split of it); or
    # the engine servers' discovery, or Ray's replicas (and search shards) placed and started.
    ENGINE_LOAD = "engine_load"
    READY = "started"


# Each phase's bound in seconds (``serve --startup-timeout PHASE=SECONDS``). Generous: a start
# under load has taken minutes (docs/vllm-cpu.md), and a bound is for a phase that will never end
# (a lock held by a stuck writer, a placement Ray cannot make), not for a slow one.
DEFAULT_BOUNDS_S: Mapping[Phase, float] = {
    Phase.IMPORTS: 300.0,
    # a first build of a large corpus may take longer: `specrag prepare` builds without a bound
    Phase.ARTEFACTS: 1800.0,
    Phase.ENGINE_LOAD: 600.0,
}

# What each phase waits for, said when it outlives its bound (a caller may say it more precisely).
_WAITS_FOR: Mapping[Phase, str] = {
    Phase.IMPORTS: "the libraries the start needs (torch, transformers, vLLM, the embedder's) to be imported",
    Phase.ARTEFACTS: (
        "the corpus, model, document store and index to be checked or built (a first build of a "
        "large corpus takes long: `specrag prepare` builds first, without a bound; another process "
        "writing an artefact holds its lock: the log says which)"
    ),
    Phase.ENGINE_LOAD: "the engine to start",
}


class StartupTimeoutError(SpecragError):
    """A start-up phase outlived its bound: the start is abandoned (the command exits)."""


def parse_bounds(given: Iterable[str], flag: str = "--startup-timeout") -> dict[Phase, float]:
    """The bounds ``PHASE=SECONDS`` strings give, over the defaults; InvalidInputError naming ``flag``."""
    bounds = dict(DEFAULT_BOUNDS_S)
    names = ", ".join(phase.value for phase in DEFAULT_BOUNDS_S)
    for text in given:
        name, equals, value = text.partition("=")
        phase = next((phase for phase in DEFAULT_BOUNDS_S if phase.value == name.strip()), None)
        if not equals or phase is None:
            raise InvalidInputError(f"{flag} {text!r}: give PHASE=SECONDS, PHASE one of {names}")
        try:
            seconds = float(value)
        except ValueError:
            seconds = math.nan
        if not (seconds > 0 and math.isfinite(seconds)):  # written so that NaN fails too
            raise InvalidInputError(f"{flag} {text!r}: the bound must be a positive number of seconds")
        bounds[phase] = seconds
    return bounds


@dataclass
class StartupProgress:
    """The phases of one start: which run now, how long each finished one took, and each one's bound.

    ``started_at`` is the command's start (``time.monotonic()``), so that ``ready_s`` is the time a
    user waited. The phases may overlap (``serve`` checks the artefacts other than the model while
    the engine loads), so their durations may add up to more than that; ``phase`` is the one that
    began last of those running. Phases begin and end on any thread (the artefact checks run on
    their own).
    """

    started_at: float = field(default_factory=time.monotonic)
    bounds_s: Mapping[Phase, float] = field(default_factory=lambda: dict(DEFAULT_BOUNDS_S))
    durations_s: dict[Phase, float] = field(default_factory=dict)
    ready_s: float | None = None
    _running: dict[Phase, tuple[float, str]] = field(init=False, default_factory=dict)
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)

    @classmethod
    def since_process_start(cls, bounds_s: Mapping[Phase, float] | None = None) -> StartupProgress:
        """Counted from this process's start: a user waits for the interpreter and imports too."""
        age_s = max(time.time() - psutil.Process().create_time(), 0.0)
        return cls(started_at=time.monotonic() - age_s, bounds_s=dict(bounds_s or DEFAULT_BOUNDS_S))

    @property
    def phase(self) -> Phase:
        """The phase that began last of those running; the first before any began."""
        with self._lock:
            if self._running:
                return max(self._running, key=lambda phase: self._running[phase][0])
        return Phase.READY if self.ready_s is not None else Phase.IMPORTS

    def begin(self, phase: Phase, waits_for: str | None = None) -> None:
        """``phase`` runs from now; ``waits_for`` says what it waits for more precisely than the
        phase's own words, should it outlive its bound."""
        with self._lock:
            self._running[phase] = (time.monotonic(), waits_for or _WAITS_FOR.get(phase, phase.value))

    def end(self, phase: Phase) -> None:
        """``phase`` is over: its duration recorded and logged."""
        with self._lock:
            began, _ = self._running.pop(phase)
        self.record(phase, time.monotonic() - began)

    def record(self, phase: Phase, seconds: float) -> None:
        """``phase`` took ``seconds``: kept for ``/health`` and logged."""
        self.durations_s[phase] = seconds
        logger.info("start-up: %s took %.1f s", phase.value.replace("_", " "), seconds)

    def overdue(self) -> str | None:
        """What to tell when a running phase has outlived its bound (the first such), else None."""
        now = time.monotonic()
        with self._lock:
            running = list(self._running.items())
        for phase, (began, waits_for) in running:
            bound = self.bounds_s.get(phase, math.inf)
            if now - began > bound:
                return (
                    f"start-up phase {phase.value} did not end within its bound of {bound:g} s: it waited "
                    f"for {waits_for}; the start is abandoned and what it started is stopped "
                    f"(--startup-timeout {phase.value}=SECONDS sets the bound)"
                )
        return None

    def ready(self) -> None:
        self.ready_s = time.monotonic() - self.started_at
        logger.info(
            "start-up: ready after %.1f s (%s)",
            self.ready_s,
            ", ".join(f"{phase.value} {seconds:.1f} s" for phase, seconds in self.durations_s.items()),
        )

    def to_dict(self) -> dict[str, Any]:
        """What ``/health`` shows: the phase, the seconds since the start, each phase's seconds and bound."""
        return {
            "phase": self.phase.value,
            "elapsed_s": round(time.monotonic() - self.started_at, 3),
            "ready_s": None if self.ready_s is None else round(self.ready_s, 3),
            "phases_s": {phase.value: round(seconds, 3) for phase, seconds in self.durations_s.items()},
            "bounds_s": {phase.value: seconds for phase, seconds in self.bounds_s.items()},
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
