"""How ``specrag serve`` runs a service from its bound port to its stop.

- **Bind first, hand over.** The port, bound before anything slow
  (:func:`specrag.service.run.startup.bind_listener`), answers from the first second with
  :func:`~specrag.service.run.startup.starting_app`; once the service is ready its application takes
  over the same socket, which stays open throughout, so no connection is refused in between.
- **Orderly stop.** SIGINT or SIGTERM: new queries get 503 at once, the answers in flight get
  ``--shutdown-timeout`` to finish (then they are cancelled and their engine requests aborted),
  then the engine shuts down through vLLM's own shutdown. A signal while the service still
  starts stops the start (``KeyboardInterrupt``).
- **A bounded start.** A start-up phase that outlives its bound
  (:meth:`~specrag.service.run.startup.StartupProgress.overdue`) cancels the start, which unwinds
  in order (an engine that started meanwhile shuts down), and the command ends with a
  :class:`~specrag.service.run.startup.StartupTimeoutError` saying which phase waited for what.
  A thread of the start cannot be cancelled (vLLM's start blocks one, an artefact check another):
  :func:`run_serving` does not wait for one that still runs after a failed start, but stops the
  processes this one started and exits, so that nothing is left running.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import threading
import traceback
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

import psutil
from aiohttp import web

from specrag.errors import REPORTED, failure_report
from specrag.service.http.app import serving
from specrag.service.http.monitoring import STARTUP
from specrag.service.run.startup import StartupProgress, StartupTimeoutError, starting_app

__all__ = ["RunningService", "run_serving", "serve_until_signalled"]

logger = logging.getLogger(__name__)

# How often the start-up phases' bounds are checked.
BOUND_CHECK_S = 0.5
# How long an abandoned start may take to unwind in order (an engine that started meanwhile shuts
# down: vLLM's shutdown takes up to about 13 s) before it is cancelled again.
UNWIND_GRACE_S = 20.0
# After a failed start: how long the event loop's threads get to end, and the processes this one
# started to stop on SIGTERM before they are killed.
THREADS_GRACE_S = 10.0
PROCESSES_GRACE_S = 5.0


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
    unwind_grace_s: float = UNWIND_GRACE_S,
) -> None:
    """Serve on ``listener`` from now until SIGINT or SIGTERM: :func:`starting_app` while
    ``start`` builds the service, then the service's application; then stop in order.

    ``announce`` prints the service's lines (where it listens, that it serves, that it stops).
    A start-up phase that outlives its bound in ``progress`` ends the start with
    :class:`StartupTimeoutError` (after an orderly unwind of at most ``unwind_grace_s``).
    """
    loop = asyncio.get_running_loop()
    main = asyncio.current_task()
    stop = asyncio.Event()
    running: list[RunningService] = []
    expired: list[str] = []
    bounds = asyncio.create_task(_enforce_bounds(progress, main, expired, unwind_grace_s))

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
            bounds.cancel()  # started: the bounds were the start's
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
        if expired:
            raise StartupTimeoutError(expired[0]) from None
        if running or main is None or not main.cancelling():
            raise
        raise KeyboardInterrupt from None  # a signal while starting: the command was interrupted
    finally:
        bounds.cancel()
        for signum in signals:
            loop.remove_signal_handler(signum)


async def _enforce_bounds(
    progress: StartupProgress, main: asyncio.Task[Any] | None, expired: list[str], unwind_grace_s: float
) -> None:
    """Once a phase of ``progress`` outlives its bound: say so in ``expired`` and cancel ``main``,
    again every ``unwind_grace_s`` while it has not ended (an orderly unwind that itself waits
    for ever, on a start that cannot be cancelled, is cut short)."""
    reason = progress.overdue()
    while reason is None:  # polled: a phase may begin on any thread, and with it its deadline
        await asyncio.sleep(BOUND_CHECK_S)
        reason = progress.overdue()
    if main is None:
        return
    expired.append(reason)
    logger.error("%s", reason)
    while not main.done():
        main.cancel()
        await asyncio.wait({main}, timeout=unwind_grace_s)


def run_serving(main: Coroutine[Any, Any, None], command: str) -> None:
    """``asyncio.run(main)``, except when ``main`` fails (a start abandoned at its bound, an
    engine that did not start): the event loop's threads get ``THREADS_GRACE_S`` to end, and if one
    still runs then (a start that cannot be cancelled: vLLM's blocks a thread, so does an artefact
    check waiting for a lock) the command says its error as ``specrag COMMAND`` would, stops the
    processes this one started (an engine's, a local Ray's) and exits at once with its status:
    Python would wait for that thread for ever."""
    runner = asyncio.Runner()
    try:
        runner.run(main)
    except BaseException as error:
        closer = threading.Thread(target=runner.close, name="closing", daemon=True)
        closer.start()
        closer.join(THREADS_GRACE_S)
        if closer.is_alive():
            _abandon(error, command)
        raise
    runner.close()


def _abandon(error: BaseException, command: str) -> None:
    """Say ``error`` as the command line would, stop this process's descendants, exit now."""
    status = 1
    if isinstance(error, REPORTED):
        line, status = failure_report(command, error)
        print(line, file=sys.stderr)
    else:
        traceback.print_exception(error)
    _stop_descendants()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _stop_descendants(grace_s: float = PROCESSES_GRACE_S) -> None:
    """SIGTERM to every process this one started (and theirs), SIGKILL to those alive ``grace_s`` later."""
    descendants = psutil.Process().children(recursive=True)
    for process in descendants:
        with contextlib.suppress(psutil.Error):
            process.terminate()
    _, alive = psutil.wait_procs(descendants, timeout=grace_s)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(alive, timeout=grace_s)
