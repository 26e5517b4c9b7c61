"""Keeping the engine and the vector search on different cores (``serve --engine-cpus --search-cpus``).

Speculative pipelining overlaps a search with a prefill. On a small machine the two overlap only
if each has cores of its own: left floating, the search thread, the event loop and the engine's
processes take turns on whatever core is free, and an overlapped search or prefill then runs
up to several times longer than alone (docs/vllm-cpu.md). Two facts decide what is pinned:

- ``VLLM_CPU_OMP_THREADS_BIND`` pins only the model worker's compute threads. vLLM's engine-core
  process floats, and it busy-polls the worker's queue for a second after each read; its I/O and
  event threads float too. So every thread of every process the engine started is pinned, not
  each process's main thread (which is all an affinity set on a process id reaches).
- This process is the service's other half: the event loop, vLLM's client threads and the
  search threads. Pinned to the search's cores, the event loop costs the search only its own CPU
  time, and never waits for a core beside the engine's spinning worker.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Collection

import psutil

__all__ = ["descendant_pids", "pin_engine_processes", "pin_threads"]

# Walks of a process's threads before pinning gives up on one that keeps starting threads.
_PIN_PASSES = 5


def pin_threads(process: psutil.Process, cpus: Collection[int]) -> None:
    """Pin every thread ``process`` has now to ``cpus`` (threads it starts later inherit it).

    A thread started while the list is walked, by a thread not pinned yet, inherits the old
    cores: so the threads are listed again until a pass finds none left off ``cpus``.
    """
    wanted = set(cpus)
    for _ in range(_PIN_PASSES):
        unpinned = [thread.id for thread in process.threads() if _affinity(thread.id) not in (None, wanted)]
        if not unpinned:
            return
        for thread_id in unpinned:
            with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                os.sched_setaffinity(thread_id, wanted)


def _affinity(thread_id: int) -> set[int] | None:
    """A thread's cores; None once it has ended."""
    try:
        return os.sched_getaffinity(thread_id)
    except ProcessLookupError:
        return None


def descendant_pids() -> set[int]:
    """The processes this one started, and theirs."""
    return {child.pid for child in psutil.Process().children(recursive=True)}


def pin_engine_processes(
    cpus: Collection[int], root: psutil.Process | None = None, *, besides: Collection[int] = ()
) -> list[str]:
    """Pin every thread of every process ``root`` (this process by default) started.

    Those are the in-process engine's: vLLM's engine core and its model worker. ``besides``:
    processes to leave alone (another engine's, started before this one). Returns the names of
    the processes pinned, for the caller to report.
    """
    pinned = []
    for child in (root or psutil.Process()).children(recursive=True):
        if child.pid in besides:
            continue
        try:
            pin_threads(child, cpus)
            pinned.append(child.name())
        except psutil.Error:  # gone meanwhile (a short-lived helper process)
            continue
    return pinned
