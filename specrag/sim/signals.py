"""How a stand-in process (``python -m specrag.sim.…``) is told to stop: SIGINT or SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Coroutine
from typing import Any

__all__ = ["run_until_interrupted", "stop_on_signals"]


def stop_on_signals() -> asyncio.Event:
    """An event the running loop sets on SIGINT or SIGTERM, so that the stand-in stops cleanly."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    return stop


def run_until_interrupted(serve: Coroutine[Any, Any, None]) -> int:
    """Run a stand-in's ``serve`` to its end; a Ctrl-C before its handlers are set ends it quietly."""
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve)
    return 0
