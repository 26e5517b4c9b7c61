"""CPU time per component of a serving process, by wrapping the functions that do each part.

Each wrapped function is timed with ``time.thread_time`` (the CPU of the thread running it),
exclusively: a metered function called inside another (a prompt built while placing one) is
charged to itself only, its caller paused meanwhile. The vector search's threads
(``specrag-search``, where the staged search runs) are charged whole, read from the kernel's
per-thread counters; what the process used beyond every meter is ``http_and_other`` (aiohttp,
the query's coroutines, JSON, speculation decisions, the event loop itself).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil

__all__ = ["COMPONENTS", "CpuMeters"]

COMPONENTS = ("embedding", "search", "ordering", "mirror", "prompt", "http_and_other")
SEARCH_THREAD_PREFIX = "specrag-search"


class CpuMeters:
    """Seconds of CPU per component since the meters were made; :meth:`wrap` installs one."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(COMPONENTS, 0.0)
        self._local = threading.local()
        self._lock = threading.Lock()
        self._process = psutil.Process()

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

    def _enter(self, component: str) -> None:
        stack: list[list[Any]] = self._local.__dict__.setdefault("stack", [])
        now = time.thread_time()
        if stack:
            self._charge(stack[-1], now)
        stack.append([component, now])

    def _leave(self) -> None:
        stack: list[list[Any]] = self._local.stack
        now = time.thread_time()
        self._charge(stack.pop(), now)
        if stack:
            stack[-1][1] = now

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
