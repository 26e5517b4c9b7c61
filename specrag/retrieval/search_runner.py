"""Running staged searches off the event loop, on pinned cores, at a lower priority, with
cancellation.

faiss and the numba HNSW kernel release the GIL, so a search in a worker thread leaves the event
loop free to drive speculative prefill. The worker runs ahead of the consumer (a search never
waits for the controller to handle a stage) and checks a cancel flag between stages, so leaving
the ``async for`` or cancelling its task stops the search after the stage in flight.

The search threads run at a higher nice value than the event loop (:data:`SEARCH_NICENESS`). Where
the two share a core, a search thread at equal priority keeps it until its time slice ends, so
the event loop, woken by a stage, submitted the speculation that stage made possible a time slice
late: that delay is prefill the search no longer hides (docs/pipelining.md, "The search's time
slice"). At a lower priority the event loop's short bursts go first, and the search still gets
every cycle they leave: it ends when it would have, having done the same work on the same core.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
from collections.abc import AsyncGenerator, Callable, Collection, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import faiss

from specrag.errors import InvalidInputError
from specrag.retrieval.stages import StageResult

__all__ = ["SEARCH_NICENESS", "SearchRunner", "pin_current_thread"]

# How much higher the search threads' nice value is than the process's: enough that a woken event
# loop preempts a search at once, yet a search beside a busy event loop still gets a tenth of
# the core under Linux's weights (not the hundredth of the lowest priority).
SEARCH_NICENESS = 10
# Linux's highest nice value.
_MAX_NICE = 19


def _checked_cpus(cpus: Collection[int]) -> frozenset[int]:
    chosen = frozenset(cpus)
    count = os.cpu_count() or 1
    if not chosen or not all(0 <= cpu < count for cpu in chosen):
        raise InvalidInputError(f"cpu set {sorted(chosen)} is not within this machine's cores 0..{count - 1}")
    return chosen


def pin_current_thread(cpus: Collection[int] | None) -> None:
    """Restrict the calling thread (and threads it starts later) to ``cpus``; None leaves it free.

    A pinned thread may widen itself again later (the kernel checks against the cgroup's cores).
    """
    if cpus is None:
        return
    try:
        os.sched_setaffinity(0, _checked_cpus(cpus))
    except OSError as error:
        raise InvalidInputError(f"cannot pin to cores {sorted(cpus)}: {error}") from error


def _lower_current_thread_priority(niceness: int) -> None:
    """Raise the calling thread's nice value by ``niceness`` (up to Linux's highest).

    On Linux a thread's nice value is its own, so this leaves the event loop's thread as it was;
    elsewhere ``setpriority`` would lower the whole process, so it does nothing there.
    """
    if niceness and sys.platform == "linux":
        current = os.getpriority(os.PRIO_PROCESS, 0)
        os.setpriority(os.PRIO_PROCESS, 0, min(_MAX_NICE, current + niceness))


def _prepare_search_thread(cpus: frozenset[int] | None, threads: int, niceness: int) -> None:
    """Pin the calling search thread, lower its priority and set its own faiss thread count."""
    pin_current_thread(cpus)
    _lower_current_thread_priority(niceness)
    faiss.omp_set_num_threads(threads)


@dataclass(frozen=True)
class _Failure:
    error: BaseException


_END = object()


class SearchRunner:
    """A small thread pool for searches, each thread with its own cores and faiss thread count.

    ``threads`` is faiss's OpenMP thread count *inside the pool's threads*; by default one per
    core in ``cpus``, or one when the threads are not pinned: a service searches one query at a
    time beside an engine that keeps cores busy (vLLM's CPU worker spins while it waits), and an
    OpenMP thread on a busy core holds up the others at every barrier. OpenMP keeps the count per
    thread, so each pool thread sets its own: set only by the thread that creates the pool, it
    never reached the pool's threads, which then ran one OpenMP thread per machine core on their
    one pinned core; on the 2-core machine such a search took 2-3x as long (1M-vector IVF index,
    half its lists: 20 ms with one thread, 40 ms in one stage, 60 ms in four).

    ``niceness`` is how much lower than the process's the pool threads' priority is (the module's
    docstring says why; 0 keeps them equal).
    """

    def __init__(
        self,
        threads: int | None = None,
        cpus: Collection[int] | None = None,
        workers: int = 1,
        niceness: int = SEARCH_NICENESS,
    ) -> None:
        if threads is not None and threads < 1:
            raise InvalidInputError(f"threads must be at least 1, got {threads}")
        if not 0 <= niceness <= _MAX_NICE:
            raise InvalidInputError(f"niceness must be within 0..{_MAX_NICE}, got {niceness}")
        chosen = None if cpus is None else _checked_cpus(cpus)
        if threads is None:
            threads = 1 if chosen is None else len(chosen)
        self._executor = ThreadPoolExecutor(
            max_workers=workers,
            thread_name_prefix="specrag-search",
            initializer=_prepare_search_thread,
            initargs=(chosen, threads, niceness),
        )

    def shutdown(self) -> None:
        """Wait for searches in flight to stop, then release the threads."""
        self._executor.shutdown(wait=True)

    async def stream(
        self, make_stages: Callable[[], Iterator[StageResult]]
    ) -> AsyncGenerator[StageResult, None]:
        """Yield the stages of ``make_stages()`` computed in a worker thread, as they complete."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[object] = asyncio.Queue()
        cancelled = threading.Event()

        def post(item: object) -> None:
            # A consumer that left may also have closed its loop: then there is no one to tell.
            if not cancelled.is_set():
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(queue.put_nowait, item)

        def produce() -> None:
            try:
                stages = make_stages()
                while not cancelled.is_set():
                    stage = next(stages, None)
                    if stage is None:
                        break
                    post(stage)
            except Exception as error:
                post(_Failure(error))
            post(_END)

        self._executor.submit(produce)
        try:
            while (item := await queue.get()) is not _END:
                if isinstance(item, _Failure):
                    raise item.error
                assert isinstance(item, StageResult)
                yield item
        finally:
            cancelled.set()
