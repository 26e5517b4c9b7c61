"""Helpers every benchmark shares: where results go, how they are written, and the tail of a run.

Every benchmark ends the same way: its measurement runs under :func:`run_measurement` (SIGTERM
shuts vLLM down), :func:`write_report` writes ``bench/out/<name>.json`` and ``<name>.png``, and
:func:`print_summary` prints how to rerun it and, as the last line, the JSON summary the docs quote.

The benchmarks pin the engine and the search apart with the service's own
``specrag.service.run.pinning``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import platform
import random
import signal
from collections.abc import Awaitable, Callable, Collection, Coroutine, Sequence
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, TypeVar

import matplotlib
import numpy as np
import psutil

from specrag.pipeline.models.catalog import MODEL_NAMES
from specrag.pipeline.models.dtype import Dtype, cpu_has_native_bf16, engine_dtypes, resolve_dtype
from specrag.service.run.pinning import pin_engine_processes, pin_threads

matplotlib.use("Agg")

from matplotlib import pyplot as plt
from matplotlib.figure import Figure

T = TypeVar("T")
U = TypeVar("U")

OUT_DIR = Path(__file__).resolve().parent / "out"
# Random prompts draw their tokens from ids 3..999: every model's vocabulary is larger, and the
# lowest ids are special tokens.
RANDOM_TOKEN_IDS = 1000


def add_model_option(parser: argparse.ArgumentParser, default: str, why: str) -> None:
    """``--model``: a model name (made offline in the data directory) or a model directory."""
    parser.add_argument(
        "--model",
        default=default,
        help=f"a model name ({', '.join(MODEL_NAMES)}) or any Hugging Face model directory "
        f"(default: %(default)s: {why})",
    )


def random_prompt(rng: random.Random, tokens: int) -> list[int]:
    """``tokens`` random token ids: a prompt no prefix cache holds."""
    return [rng.randrange(3, RANDOM_TOKEN_IDS) for _ in range(tokens)]


def cpu_model() -> str:
    """The CPU's name from /proc/cpuinfo (``platform.processor()`` is often empty on Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def debian_version() -> str | None:
    """``/etc/debian_version`` (e.g. ``12.11``), or None off Debian: the system libraries' age."""
    try:
        return Path("/etc/debian_version").read_text().strip() or None
    except OSError:
        return None


def machine() -> dict[str, Any]:
    """What the numbers were measured on, recorded next to them (by :func:`write_json`).

    Whether the CPU has native bfloat16 matters as much as its core count: it decides the default
    model's size and dtype, and vLLM's CPU speed differs by ~10x between such machines. Hence
    ``dtype_auto`` (what a CPU engine started with ``auto`` computes in here: ``auto`` is the
    model's own, bfloat16 for the default model) and ``engine_dtypes`` (what the engines this
    process started did compute in, as vLLM resolved it; empty where none ran in-process).
    """
    return {
        "platform": platform.platform(),
        "debian": debian_version(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model(),
        "native_bf16": cpu_has_native_bf16(),
        "dtype_auto": str(resolve_dtype(Dtype.AUTO, on_cpu=True)),
        "engine_dtypes": engine_dtypes(),
    }


def write_json(name: str, data: dict[str, Any]) -> Path:
    """Write ``bench/out/<name>.json`` (pretty, stable key order) and return its path.

    It sets ``data["machine"]`` to :func:`machine`, taken now, after the measurement: every
    benchmark's figures then name the machine and the engine's dtype without code of its own,
    and a benchmark cannot record the machine before its engine settled the dtype.
    """
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    path = OUT_DIR / f"{name}.json"
    data = {**data, "machine": machine()}
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return path


def plot_path(name: str) -> Path:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    return OUT_DIR / f"{name}.png"


def write_report(name: str, data: dict[str, Any], draw: Callable[[Path], object]) -> tuple[Path, Path]:
    """Write ``bench/out/<name>.json`` and have ``draw`` save the figure at ``<name>.png``."""
    json_path = write_json(name, data)
    png_path = plot_path(name)
    draw(png_path)
    return json_path, png_path


def save_figure(figure: Figure, path: Path, dpi: int = 120) -> Path:
    """Lay the figure out, save it at ``path`` and free it (pyplot keeps every open figure)."""
    figure.tight_layout()
    figure.savefig(path, dpi=dpi)
    plt.close(figure)
    return path


def print_summary(summary: Any, rerun: str | None = None) -> None:
    """How to rerun the benchmark, then its JSON summary: the last line, which docs and scripts read."""
    if rerun is not None:
        print(f"rerun: .venv/bin/python -m {rerun}")
    print(json.dumps(summary), flush=True)


def run_measurement(measurement: Coroutine[Any, Any, T]) -> T:
    """Run a benchmark's asyncio measurement to its end; SIGTERM unwinds it like Ctrl-C."""
    stop_cleanly_on_sigterm()
    return asyncio.run(measurement)


async def map_bounded(work: Callable[[T], Awaitable[U]], items: Sequence[T], limit: int) -> list[U]:
    """``work`` on every item, at most ``limit`` at once, the results in the items' order.

    Answers that only need to be right (not timed) are asked together so that vLLM batches their
    decoding; the order is kept so that each result still pairs with its question. The first
    failure is raised and the work still running is cancelled.
    """
    if limit < 1:
        raise ValueError(f"the concurrency limit must be at least 1, got {limit}")
    gate = asyncio.Semaphore(limit)

    async def one(item: T) -> U:
        async with gate:
            return await work(item)

    tasks = [asyncio.ensure_future(one(item)) for item in items]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def stop_cleanly_on_sigterm() -> None:
    """Make SIGTERM (``kill``, ``timeout``) unwind like Ctrl-C, so ``finally`` blocks shut vLLM down.

    Python's default SIGTERM ends the process at once and orphans the engine-core processes it
    started; KeyboardInterrupt makes ``asyncio.run`` cancel the main task and run its clean-up.
    """

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)


def pin_apart(engine_cpus: Collection[int], service_cpus: Collection[int]) -> list[str]:
    """The engine's processes on ``engine_cpus``, this process on ``service_cpus``.

    Returns the names of the engine processes pinned.
    """
    pin_threads(psutil.Process(), service_cpus)
    return pin_engine_processes(engine_cpus)


def cpu_seconds() -> tuple[float, float]:
    """CPU seconds (user + system) used so far by this process and by its live descendants (the
    in-process engine's). On a shared machine the wall time of a phase says little; the engine's
    CPU seconds bound what it would take on a quiet one from above (they sum the engine's
    processes, its polling loop included, and contention inflates them)."""
    own = psutil.Process()
    times = own.cpu_times()
    children = 0.0
    for child in own.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            child_times = child.cpu_times()
            children += child_times.user + child_times.system
    return times.user + times.system, children


def engine_cores() -> list[BaseProcess]:
    """vLLM's engine-core child processes (one per running engine; dead ones are reaped here)."""
    return [child for child in multiprocessing.active_children() if "EngineCore" in child.name]


BOOTSTRAP_SAMPLES = 2000


def bootstrap_mean_ci(values: np.ndarray, rng: np.random.Generator) -> list[float]:
    """A 95 % bootstrap interval of the mean of ``values`` (one value a question), resampling
    questions; a paired difference is passed as the per-question differences."""
    picks = rng.integers(0, len(values), size=(BOOTSTRAP_SAMPLES, len(values)))
    low, high = np.percentile(values[picks].mean(axis=1), [2.5, 97.5])
    return [float(low), float(high)]


def bootstrap_ratio_ci(
    numerator: np.ndarray, denominator: np.ndarray, rng: np.random.Generator
) -> list[float]:
    """A 95 % bootstrap interval of ``sum(numerator) / sum(denominator)``, resampling the pairs
    together (one pair a question or a block of requests), so a share of a gain measured on the
    same questions keeps their pairing."""
    picks = rng.integers(0, len(numerator), size=(BOOTSTRAP_SAMPLES, len(numerator)))
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = numerator[picks].sum(axis=1) / denominator[picks].sum(axis=1)
    low, high = np.percentile(ratios, [2.5, 97.5])
    return [float(low), float(high)]


def percentile_ci(values: np.ndarray, q: float, rng: np.random.Generator) -> list[float]:
    """A 95 % bootstrap interval of the ``q``-th percentile of ``values``."""
    picks = rng.integers(0, len(values), size=(1000, len(values)))
    estimates = np.percentile(values[picks], q, axis=1)
    return [float(np.percentile(estimates, 2.5)), float(np.percentile(estimates, 97.5))]
