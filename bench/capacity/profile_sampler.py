"""Where a process's CPU goes, by component: a sampling profiler needing no package.

py-spy is not installed here (and nothing may be installed), and cProfile slows every call it
traces, which moves the costs it measures. So a CPU-time timer (``ITIMER_PROF``) interrupts the
process every ``interval_s`` of CPU it uses; the handler reads each Python thread's stack
(``sys._current_frames``) and its CPU clock (``pthread_getcpuclockid``), and charges the CPU time
the thread used since the last tick to the stack it has now. A sampling *thread* would be a
biased judge: it gets the GIL mostly when the event loop releases it, at a socket write or a
thread-pool hand-off, and would charge those sites with the CPU spent before them; a signal lands
where the CPU is being spent. A thread that waited meanwhile used no CPU and is charged nothing,
whatever its stack says; one now waiting (the loop in its selector, a pool worker) has its CPU
charged to the stack it had when last seen busy. CPU spent by threads Python does not know
(faiss' OpenMP or torch's pools) is the process's CPU less the Python threads', reported as
``native threads``. The handler's own CPU is left out of every figure.

Components are recognised by the modules in a stack (:data:`COMPONENTS`): the first rule that
some frame matches, innermost frame first within each rule, so that the simulated engine's steps
and the mirror's tree updates count as theirs although they run in the cache's modules.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import FrameType

import psutil

__all__ = ["COMPONENTS", "CpuProfile", "FrameSampler", "classify", "largest"]

# (component, path fragments, function names or None for any): checked in this order; a frame
# matches when its file's path contains a fragment (and its function is named, if names are
# given). Overrides come first: the stand-in engine and the mirror run the cache's code, the
# embedding runs inside the retrieval package.
COMPONENTS: tuple[tuple[str, tuple[str, ...], frozenset[str] | None], ...] = (
    ("engine stand-in", ("specrag/sim/",), None),
    ("mirror", ("specrag/pipeline/kv_mirror/",), None),
    ("mirror", ("specrag/cache/tree.py",), frozenset({"apply_events"})),
    (
        "embedding",
        ("_embedder.py", "specrag/retrieval/embedders/embedder.py", "transformers/", "torch/"),
        None,
    ),
    ("embedding", ("specrag/retrieval/vector_index.py",), frozenset({"embed_query"})),
    ("metrics", ("prometheus_client/", "specrag/service/http/metrics.py", "controller/timeline.py"), None),
    ("search", ("specrag/retrieval/", "faiss/", "bm25s/", "hnswlib"), None),
    (
        "prompt/tokenization",
        ("specrag/pipeline/store/", "specrag/cache/layout.py", "pipeline/models/", "tokenizers/"),
        None,
    ),
    ("ordering", ("specrag/cache/", "specrag/controller/placement.py", "controller/tiers.py"), None),
    (
        "speculation",
        ("controller/speculation", "controller/gate.py", "controller/flight.py", "controller/warmup.py"),
        None,
    ),
    ("controller other", ("specrag/controller/",), None),
    ("http", ("aiohttp/", "specrag/service/http/", "json/", "multidict", "yarl/"), None),
    ("thin front end", ("bench/capacity/thin.py",), None),
    ("event loop", ("asyncio/",), None),
)
NATIVE = "native threads"
OTHER = "other"


def _stack(frame: FrameType | None) -> Iterator[FrameType]:
    """The frames of a stack, innermost first."""
    while frame is not None:
        yield frame
        frame = frame.f_back


def classify(frame: FrameType | None) -> str:
    """The component a stack's CPU is charged to (:data:`COMPONENTS`), :data:`OTHER` if none."""
    stack = [(f.f_code.co_filename, f.f_code.co_name) for f in _stack(frame)]
    for component, fragments, functions in COMPONENTS:
        for filename, function in stack:
            if any(fragment in filename for fragment in fragments) and (
                functions is None or function in functions
            ):
                return component
    return OTHER


# Where a thread waits without using CPU: the CPU it used since the last sample was spent before
# it came here, so it is charged to the stack seen at that sample (the thread pool's worker
# waiting for work, the event loop's selector).
_IDLE_SITES = frozenset({("thread.py", "_worker"), ("selectors.py", "select"), ("threading.py", "wait")})


def _idle(frame: FrameType) -> bool:
    return (frame.f_code.co_filename.rsplit("/", 1)[-1], frame.f_code.co_name) in _IDLE_SITES


def _site(frame: FrameType) -> str:
    """``package/module.py:function`` of a frame, short enough for a table."""
    parts = frame.f_code.co_filename.replace("\\", "/").split("/")
    return f"{'/'.join(parts[-2:])}:{frame.f_code.co_name}"


@dataclass
class CpuProfile:
    """CPU seconds per component, per innermost frame (self) and per frame anywhere in the stack
    (inclusive), with the process's and the loop thread's CPU over the same interval."""

    by_component: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    self_sites: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    inclusive_sites: defaultdict[str, float] = field(default_factory=lambda: defaultdict(float))
    process_cpu_s: float = 0.0
    loop_thread_cpu_s: float = 0.0
    sampler_cpu_s: float = 0.0
    wall_s: float = 0.0
    samples: int = 0

    def ms_per(self, count: int) -> dict[str, float]:
        """Each component's CPU milliseconds per one of ``count`` answers, largest first."""
        return {name: round(1000 * s / count, 3) for name, s in largest(self.by_component)}


def largest(seconds: dict[str, float], count: int | None = None) -> list[tuple[str, float]]:
    """The ``count`` largest entries (all when None), largest first."""
    return sorted(seconds.items(), key=lambda item: -item[1])[:count]


class FrameSampler:
    """Samples every Python thread (see the module doc) while the block runs, in the main thread."""

    def __init__(self, interval_s: float = 0.002) -> None:
        self.interval_s = interval_s
        self.profile = CpuProfile()
        self._main = threading.main_thread().ident
        self._clocks: dict[int, tuple[int, float]] = {}
        self._last_busy: dict[int, tuple[str, str, set[str]]] = {}
        self._last_tick_s = 0.0  # the previous tick's own CPU, inside the main thread's next delta

    def __enter__(self) -> FrameSampler:
        self._process_start = _process_cpu()
        self._wall_start = time.perf_counter()
        self._previous = signal.signal(signal.SIGPROF, self._tick)
        signal.setitimer(signal.ITIMER_PROF, self.interval_s, self.interval_s)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, self._previous)
        profile = self.profile
        profile.wall_s = time.perf_counter() - self._wall_start
        profile.process_cpu_s = _process_cpu() - self._process_start
        python_threads = sum(profile.by_component.values())
        native = profile.process_cpu_s - python_threads - profile.sampler_cpu_s
        if native > 0:
            profile.by_component[NATIVE] += native

    def _thread_cpu(self, ident: int) -> tuple[int, float] | None:
        """(clock id, CPU seconds) of thread ``ident``; None once it has ended."""
        try:
            clock = self._clocks[ident][0] if ident in self._clocks else time.pthread_getcpuclockid(ident)
            return clock, time.clock_gettime(clock)
        except (OSError, ProcessLookupError):
            return None

    def _tick(self, signum: int, frame: FrameType | None) -> None:
        """Every ``interval_s`` of the process's CPU: each thread's CPU since the last tick, charged."""
        if frame is not None and frame.f_code is FrameSampler._tick.__code__:
            return  # a tick that came while the last one ran: that CPU is the handler's own
        started = time.thread_time()
        frames = sys._current_frames()
        if frame is not None and self._main is not None:
            frames[self._main] = frame  # where the main thread was, not this handler
        self._sample(frames)
        self._last_tick_s = time.thread_time() - started
        self.profile.sampler_cpu_s += self._last_tick_s

    def _sample(self, frames: dict[int, FrameType]) -> None:
        profile = self.profile
        profile.samples += 1
        for ident, frame in frames.items():
            now = self._thread_cpu(ident)
            if now is None:
                continue
            before = self._clocks.get(ident)
            self._clocks[ident] = now
            if before is None:
                continue
            used = now[1] - before[1]
            if ident == self._main:
                used -= self._last_tick_s
                profile.loop_thread_cpu_s += max(used, 0.0)
            if used <= 0:
                continue
            busy = (classify(frame), _site(frame), {_site(f) for f in _stack(frame)})
            if _idle(frame):
                busy = self._last_busy.get(ident, busy)
            else:
                self._last_busy[ident] = busy
            component, site, sites = busy
            profile.by_component[component] += used
            profile.self_sites[site] += used
            for each in sites:
                profile.inclusive_sites[each] += used


def _process_cpu() -> float:
    times = psutil.Process().cpu_times()
    return times.user + times.system
