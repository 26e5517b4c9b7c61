"""Running staged searches off the event loop, on pinned cores, at idle priority, with
cancellation.

faiss and the numba HNSW kernel release the GIL, so a search in a worker thread leaves the event
loop free to drive speculative prefill. The worker runs ahead of the consumer (a search never
waits for the controller to handle a stage) and checks a cancel flag between stages, so leaving
the ``async for`` or cancelling its task stops the search after the stage in flight.

Pinned search threads run under Linux's ``SCHED_IDLE`` policy. Where they share a core with
the event loop (``--search-cpus`` pins the whole service there), a search thread of normal
policy keeps the core until its time slice ends, so the event loop, woken by a stage, submitted
the speculation that stage made possible a slice late: prefill the search no longer hides. A
higher nice value did not help (the kernel lets the running thread finish its slice whatever
its weight); a thread of idle policy is preempted at once by any other that wakes. The search
still gets every cycle the event loop leaves, so it ends when it would have, having done the
same work on the same core; what it gives up is its share while a normal thread is always
runnable on its cores (docs/pipelining.md, "The search's time slice"). Unpinned threads keep the
process's policy: they may share cores with anything, an engine that spins while it waits
included, beside which an idle-policy search would hardly run.
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
from specrag.retrieval.search.stages import StageResult

__all__ = ["SearchRunner", "pin_current_thread"]


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


def _yield_to_other_threads() -> None:
    """Put the calling thread under ``SCHED_IDLE`` (Linux, where a thread's policy is its own;
    elsewhere it would apply to the whole process, so nothing is done). A kernel that refuses
    leaves it at normal policy: the search then runs as it did before."""
    if sys.platform == "linux":
        with contextlib.suppress(OSError):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def _prepare_search_thread(cpus: frozenset[int] | None, threads: int, idle: bool) -> None:
    """Pin the calling search thread, set its policy and its own faiss thread count."""
    pin_current_thread(cpus)
    if idle:
        _yield_to_other_threads()
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
    one pinned core, and a search took several times as long (docs/pipelining.md has the figures).

    ``idle``: the pool threads run under ``SCHED_IDLE`` (the module's docstring says why); by
    default they do when pinned to ``cpus`` (cores given to the service) and keep the process's
    policy when not.
    """

    def __init__(
        self,
        threads: int | None = None,
        cpus: Collection[int] | None = None,
        workers: int = 1,
        idle: bool | None = None,
    ) -> None:
        if threads is not None and threads < 1:
            raise InvalidInputError(f"threads must be at least 1, got {threads}")
        chosen = None if cpus is None else _checked_cpus(cpus)
        if threads is None:
            threads = 1 if chosen is None else len(chosen)
        if idle is None:
            idle = chosen is not None  # pinned: cores given to the service
        self._executor = ThreadPoolExecutor(
            max_workers=workers,
            thread_name_prefix="specrag-search",
            initializer=_prepare_search_thread,
            initargs=(chosen, threads, idle),
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
            # The last stage (``done``) ends the stream by itself: no end marker after it, one
            # hand-off to the loop fewer a search (each wakes the loop's thread: not free).
            ended = False
            try:
                stages = make_stages()
                while not cancelled.is_set():
                    stage = next(stages, None)
                    if stage is None:
                        break
                    post(stage)
                    ended = stage.done
            except Exception as error:
                post(_Failure(error))
                ended = False
            if not ended:
                post(_END)

        self._executor.submit(produce)
        try:
            while (item := await queue.get()) is not _END:
                if isinstance(item, _Failure):
                    raise item.error
                assert isinstance(item, StageResult)
                yield item
                if item.done:
                    return
        finally:
            cancelled.set()
