"""How ``specrag serve`` runs a service from its bound port to its stop.

- **Bind first, hand over.** The port, bound before anything slow
  (:func:`specrag.service.run.startup.bind_listener`), answers from the first second with
  :func:`~specrag.service.run.startup.starting_app`; once the service is ready its application takes
  over the same socket, which stays open throughout, so no connection is refused in between.
- **Orderly stop.** SIGINT or SIGTERM: new queries get 503 at once, the answers in flight get
  ``--shutdown-timeout`` to finish (then they are cancelled and their engine requests aborted),
  then the engine shuts down through vLLM's own shutdown. A signal while the service still
  starts stops the start (``KeyboardInterrupt``).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
from collections.abc import Callable
from typing import Protocol

from aiohttp import web

from specrag.service.http.app import serving
from specrag.service.http.monitoring import STARTUP
from specrag.service.run.startup import StartupProgress, starting_app

__all__ = ["RunningService", "serve_until_signalled"]


class RunningService(Protocol):
    """What a running service offers its command (:class:`specrag.service.run.assembly.Service`)."""

    @property
    def app(self) -> web.Application: ...

    def begin_shutdown(self) -> None: ...


async def serve_until_signalled(
    listener: socket.socket,
    progress: StartupProgress,
    start: Callable[[], contextlib.AbstractAsyncContextManager[RunningService]],
    *,
    shutdown_timeout_s: float,
    announce: Callable[[str], None],
) -> None:
    """Serve on ``listener`` from now until SIGINT or SIGTERM: :func:`starting_app` while
    ``start`` builds the service, then the service's application; then stop in order.

    ``announce`` prints the service's lines (where it listens, that it serves, that it stops).
    """
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    stop = asyncio.Event()
    running: list[RunningService] = []

    def signalled() -> None:
        if not running:  # still starting: nothing in flight to let finish
            if main is not None:
                main.cancel()
            return
        # At once, in the handler: from now on new queries get 503 and engine failures are the
        # shutdown's, not faults to repair.
        running[0].begin_shutdown()
        stop.set()

    signals = (signal.SIGINT, signal.SIGTERM)
    for signum in signals:
        loop.add_signal_handler(signum, signalled)
    try:
        async with contextlib.AsyncExitStack() as stack:
            starting = contextlib.AsyncExitStack()
            stack.push_async_exit(starting)
            url = await starting.enter_async_context(
                serving(starting_app(progress), sock=listener, access_log=False)
            )
            announce(f"specrag listening on {url}: starting (GET /health tells the phase)")
            service = await stack.enter_async_context(start())
            service.app[STARTUP] = progress
            async with serving(service.app, sock=listener, shutdown_timeout_s=shutdown_timeout_s) as url:
                await starting.aclose()  # the service's application alone answers from now on
                running.append(service)
                progress.ready()
                announce(f"specrag serving on {url} after {progress.ready_s:.0f} s (Ctrl-C to stop)")
                await stop.wait()
                announce(
                    f"stopping: new queries get 503, queries in flight have {shutdown_timeout_s:g} s "
                    "to finish; then the engine shuts down…"
                )
    except asyncio.CancelledError:
        if running or main is None or not main.cancelling():
            raise
        raise KeyboardInterrupt from None  # a signal while starting: the command was interrupted
    finally:
        for signum in signals:
            loop.remove_signal_handler(signum)
