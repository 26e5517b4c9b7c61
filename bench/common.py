"""Helpers every benchmark shares: where results go, and how they are written."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import signal
from pathlib import Path
from typing import Any

import matplotlib
import psutil

from specrag.pipeline.config import cpu_has_native_bf16

matplotlib.use("Agg")

OUT_DIR = Path(__file__).resolve().parent / "out"


def cpu_model() -> str:
    """The CPU's name from /proc/cpuinfo (``platform.processor()`` is often empty on Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine() -> dict[str, Any]:
    """What the numbers were measured on, recorded next to them.

    Whether the CPU has native bfloat16 matters as much as its core count: it decides the default
    model's size and dtype, and vLLM's CPU speed differs by ~10x between such machines.
    """
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model(),
        "native_bf16": cpu_has_native_bf16(),
    }


def write_json(name: str, data: dict[str, Any]) -> Path:
    """Write ``bench/out/<name>.json`` (pretty, stable key order) and return its path."""
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    path = OUT_DIR / f"{name}.json"
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path


def plot_path(name: str) -> Path:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    return OUT_DIR / f"{name}.png"


def stop_cleanly_on_sigterm() -> None:
    """Make SIGTERM (``kill``, ``timeout``) unwind like Ctrl-C, so ``finally`` blocks shut vLLM down.

    Python's default SIGTERM ends the process at once and orphans the engine-core processes it
    started; KeyboardInterrupt makes ``asyncio.run`` cancel the main task and run its clean-up.
    """

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)


def pin_engine_processes(cpus: set[int], root: psutil.Process | None = None) -> list[str]:
    """Pin every thread of every process this one started (vLLM's engine core, its model worker).

    ``VLLM_CPU_OMP_THREADS_BIND`` pins only the model worker's compute threads; vLLM's
    engine-core process floats, and while the worker computes it busy-polls the worker's
    shared-memory queue (it spins with ``sched_yield`` for a second after each read; see
    docs/vllm-cpu.md). Every thread is pinned, not only each process's main thread (which is
    all an affinity set on a process id reaches): the engine's I/O and event threads left
    floating run on the search's core exactly when search and prefill overlap. Returns the names
    of the processes pinned, for the benchmark's output. ``root``: whose descendants (this
    process by default).
    """
    pinned = []
    for child in (root or psutil.Process()).children(recursive=True):
        try:
            pin_threads(child, cpus)
            pinned.append(child.name())
        except psutil.Error:  # gone meanwhile (a short-lived helper process)
            continue
    return pinned


def pin_threads(process: psutil.Process, cpus: set[int]) -> None:
    """Pin every thread ``process`` has now to ``cpus`` (threads it starts later inherit it)."""
    for thread in process.threads():
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(thread.id, cpus)


def pin_apart(engine_cpus: set[int], service_cpus: set[int]) -> list[str]:
    """The engine's processes on ``engine_cpus``, this process on ``service_cpus``.

    This process is the service's other half (the event loop, vLLM's client threads, the
    search threads). Pinned apart, the two never share a core: left floating, the event loop
    may run beside the engine's spinning worker, and a thread descheduled there while it holds
    the GIL holds up the search thread, which takes the GIL between stages. On the search's
    cores the loop costs the search only its own CPU time (a few percent of the search's in
    ``bench.pipeline``). Returns the names of the engine processes pinned.
    """
    pin_threads(psutil.Process(), service_cpus)
    return pin_engine_processes(engine_cpus)
