"""CPU time per component of a serving process, by wrapping the functions that do each part.

Each wrapped function is timed with ``time.thread_time`` (the CPU of the thread running it),
exclusively: a metered function called inside another (a prompt built while placing one) is
charged to itself only, its caller paused meanwhile. The vector search's threads
(``specrag-search``, where the staged search runs) are charged whole, read from the kernel's
per-thread counters; what the process used beyond every meter is ``http_and_other`` (aiohttp,
the query's coroutines, JSON, speculation decisions, the event loop itself).

The garbage collector's passes are a component of their own (``gc``, through ``gc.callbacks``): a
collection runs on whichever thread allocated when a threshold was reached, so without its own
meter a full collection's pause would be charged to the function that happened to be running
(ordering, most often: it allocates the most on the loop).
"""

from __future__ import annotations

import functools
import gc
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil

__all__ = ["COMPONENTS", "CpuMeters"]

COMPONENTS = ("embedding", "search", "ordering", "mirror", "prompt", "gc", "http_and_other")
SEARCH_THREAD_PREFIX = "specrag-search"


class CpuMeters:
    """Seconds of CPU per component since the meters were made; :meth:`wrap` installs one."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(COMPONENTS, 0.0)
        self._local = threading.local()
        self._lock = threading.RLock()  # a collection may start inside snapshot's hold of it
        self._process = psutil.Process()
        gc.callbacks.append(self._collecting)

    def wrap(self, owner: Any, name: str, component: str) -> None:
        """Meter ``owner.name`` (a class's method or a module's function) as ``component``."""
        original: Callable[..., Any] = getattr(owner, name)  # a missing name fails here, loudly
        meters = self

        @functools.wraps(original)
        def metered(*args: Any, **kwargs: Any) -> Any:
            meters._enter(component)
            try:
                return original(*args, **kwargs)
            finally:
                meters._leave()

        setattr(owner, name, metered)

    def _collecting(self, phase: str, info: dict[str, int]) -> None:
        """A collection's start and stop, metered as ``gc``; one that starts while a meter itself
        updates (it allocates too) stays in the component running then, and one on a search
        thread in ``search`` (charged whole)."""
        if getattr(self._local, "updating", False) or threading.current_thread().name.startswith(
            SEARCH_THREAD_PREFIX
        ):
            return
        if phase == "start":
            self._local.collecting = True
            self._enter("gc")
        elif getattr(self._local, "collecting", False):
            self._local.collecting = False
            self._leave()

    def _enter(self, component: str) -> None:
        self._local.updating = True
        stack: list[list[Any]] = self._local.__dict__.setdefault("stack", [])
        now = time.thread_time()
        if stack:
            self._charge(stack[-1], now)
        stack.append([component, now])
        self._local.updating = False

    def _leave(self) -> None:
        self._local.updating = True
        stack: list[list[Any]] = self._local.stack
        now = time.thread_time()
        self._charge(stack.pop(), now)
        if stack:
            stack[-1][1] = now
        self._local.updating = False

    def _charge(self, frame: list[Any], now: float) -> None:
        with self._lock:
            self.seconds[frame[0]] += now - frame[1]

    def snapshot(self) -> dict[str, float]:
        """CPU seconds per component so far, and the process's total (``total``)."""
        times = self._process.cpu_times()
        total = times.user + times.system
        names = {thread.native_id: thread.name for thread in threading.enumerate()}
        search = sum(
            thread.user_time + thread.system_time
            for thread in self._process.threads()
            if names.get(thread.id, "").startswith(SEARCH_THREAD_PREFIX)
        )
        with self._lock:
            seconds = dict(self.seconds)
        seconds["search"] += search
        metered = sum(value for key, value in seconds.items() if key != "http_and_other")
        seconds["http_and_other"] = max(0.0, total - metered)
        return {**seconds, "total": total}
