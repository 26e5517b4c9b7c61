"""Where specrag's CPU per answer goes in front of fast replicas, against a thin RAG front end.

In front of GPU replicas the engine is no longer the slow part: specrag's own work per answer,
on one Python event loop, sets how many answers a second one process holds. This profile builds
the stack as the service does (:func:`specrag.service.run.assembly.serving_engines`: the same
replicas, trees, placement, controller and aiohttp application) over the data directory's corpus
and index, in front of ``--replicas`` simulated engines made nearly free (a GPU's pace: prefill
``--prefill-us-per-token`` per uncached token in one step, ``--decode-ms`` per token; their KV
events feed each replica's tree as a mirror does), and beside it, in the same run, the thin front
end of :mod:`bench.capacity.thin` over the same index, prompts and engines.

For each configuration (``thin``, specrag in ``serial`` mode, specrag in the default ``all``) a
client process (:mod:`bench.capacity.profile_load`) first asks with ``--concurrency`` clients back
to back (saturation: answers/s is the capacity), then with Poisson arrivals at half that rate
(TTFT p50/p99 at half capacity), while :mod:`bench.capacity.profile_sampler` charges every CPU
second of this process to a component (embedding, search, ordering, mirror, prompt/tokenization,
speculation, HTTP, metrics, event loop, the simulated engines, ...). The simulated engines' own
CPU is reported apart and left out of the per-answer figures that compare the front ends: real
replicas spend theirs in their own processes. The top frames (self and inclusive) say which
functions to make cheaper.

Run ``python -m bench.capacity.profile`` (``--quick``: shorter windows); it prints the table and
writes ``bench/out/capacity-profile.json`` and ``.png``. Needs the data directory's assets
(``specrag prepare``; ``--embedder`` picks the index's embedder, as serve does).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import pyplot as plt

from bench.capacity.profile_load import Load, Timing, running_load
from bench.capacity.profile_sampler import CpuProfile, FrameSampler, largest
from bench.capacity.thin import thin_app
from bench.common import plot_path, print_summary, run_measurement, save_figure, write_json
from bench.quality.questions import build_questions
from specrag.cache.events import KVEvent
from specrag.cache.pgdsf import PrefillProfile
from specrag.cache.tree import KnowledgeTree
from specrag.controller.config import ControllerConfig
from specrag.paths import DataLayout, resolve_data_dir
from specrag.retrieval.backends.registry import data_directory
from specrag.retrieval.index_store import default_embedder
from specrag.service.http.access import Access
from specrag.service.http.app import serving
from specrag.service.run.assembly import prompt_builder, serving_engines
from specrag.service.run.assets import Assets, ensure_assets
from specrag.service.run.options import ServiceOptions
from specrag.service.run.pools import PoolEngine
from specrag.sim.engine import SimulatedEngine
from specrag.sim.requests import TimeModel

NAME = "capacity-profile"
CONFIGURATIONS = ("thin", "serial", "all")
TOP_FRAMES = 40


@dataclass(frozen=True)
class Settings:
    replicas: int
    concurrency: int
    warm_s: float
    measure_s: float
    k: int
    max_tokens: int
    prefill_us_per_token: float
    decode_ms: float


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench.capacity.profile", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--data-dir", default=None, help="the assets' data directory (default: as serve's)")
    parser.add_argument(
        "--embedder", default=default_embedder(), help="the index's embedder (default: %(default)s)"
    )
    parser.add_argument("--replicas", type=int, default=4, help="simulated replicas (default: %(default)s)")
    parser.add_argument(
        "--concurrency", type=int, default=32, help="closed-loop clients (default: %(default)s)"
    )
    parser.add_argument(
        "--measure-s", type=float, default=12.0, help="each profiled window (default: %(default)s)"
    )
    parser.add_argument("--k", type=int, default=6, help="documents per prompt (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=16, help="answer tokens (default: %(default)s)")
    parser.add_argument(
        "--prefill-us-per-token",
        type=float,
        default=10.0,
        help="the replicas' prefill per uncached token, microseconds (default: %(default)s: an 8B "
        "model on one H100 prefills 2k tokens in about 20 ms)",
    )
    parser.add_argument(
        "--decode-ms", type=float, default=10.0, help="per answer token (default: %(default)s)"
    )
    parser.add_argument(
        "--configurations", default=",".join(CONFIGURATIONS), help="which to run (default: %(default)s)"
    )
    parser.add_argument("--quick", action="store_true", help="5 s windows")
    return parser


def _engine(settings: Settings, on_kv_events: Callable[[Sequence[KVEvent]], None] | None) -> SimulatedEngine:
    """A replica at a GPU's pace: a whole prompt prefilled in one step, costs from ``settings``."""
    per_token = settings.prefill_us_per_token / 1e6
    time_model = TimeModel(
        prefill=PrefillProfile([(0, 0.0), (8192, 8192 * per_token)]),
        decode_step_s=settings.decode_ms / 1000,
        step_overhead_s=0.0,
    )
    return SimulatedEngine(
        time_model=time_model,
        max_num_batched_tokens=16384,
        long_prefill_token_threshold=8192,
        max_num_seqs=256,
        capacity_blocks=65536,
        on_kv_events=on_kv_events,
    )


@contextlib.asynccontextmanager
async def _thin(assets: Assets, settings: Settings) -> AsyncIterator[str]:
    engines = [_engine(settings, None) for _ in range(settings.replicas)]
    builder = prompt_builder(assets, engines[0])
    try:
        async with serving(thin_app(assets.index, builder, engines, settings.k), access_log=False) as url:
            yield url
    finally:
        for engine in engines:
            await engine.close()


@contextlib.asynccontextmanager
async def _specrag(assets: Assets, settings: Settings) -> AsyncIterator[str]:
    """The service's stack over simulated replicas whose KV events feed their trees."""
    trees: list[KnowledgeTree | None] = [None] * settings.replicas

    def feeding(number: int) -> Callable[[Sequence[KVEvent]], None]:
        def feed(events: Sequence[KVEvent]) -> None:
            tree = trees[number]
            if tree is not None:
                tree.apply_events(events)

        return feed

    engines = [_engine(settings, feeding(i)) for i in range(settings.replicas)]
    members = [PoolEngine(str(i), engine, None) for i, engine in enumerate(engines)]
    many = settings.concurrency * 4
    options = ServiceOptions(
        controller=ControllerConfig(), access=Access(max_queries=many, max_queries_per_client=many)
    )
    try:
        async with serving_engines(members, assets, options) as service:
            for number, replica in enumerate(service.placement.replicas):
                trees[number] = replica.tree
            async with serving(service.app, access_log=False) as url:
                yield url
    finally:
        for engine in engines:
            await engine.close()


async def _window(
    load: Load, warm_s: float, measure_s: float
) -> tuple[CpuProfile, list[Timing], float, float]:
    """Drive ``load`` and profile ``measure_s`` of it after ``warm_s``: the profile, the client's
    timings, and the window's ends."""
    async with running_load(load) as timings:
        await asyncio.sleep(warm_s)
        start = time.monotonic()
        with FrameSampler() as sampler:
            await asyncio.sleep(measure_s)
        end = time.monotonic()
        return sampler.profile, await timings, start, end


def _percentiles(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"p50_ms": None, "p99_ms": None}
    array = np.asarray(values) * 1000
    return {
        "p50_ms": round(float(np.percentile(array, 50)), 2),
        "p99_ms": round(float(np.percentile(array, 99)), 2),
    }


def _summary(profile: CpuProfile, timings: list[Timing], start: float, end: float) -> dict[str, Any]:
    """Answers/s, TTFT and CPU per answer (by component; the simulated engines' apart) in a window."""
    done = [t for t in timings if start <= t.end <= end]
    answered = sum(1 for t in done if t.ok)
    count = max(answered, 1)
    components = profile.ms_per(count)
    engine_ms = components.get("engine stand-in", 0.0)
    front_ms = round(
        1000 * profile.process_cpu_s / count - engine_ms - 1000 * profile.sampler_cpu_s / count, 3
    )
    loop_ms = 1000 * profile.loop_thread_cpu_s / count
    return {
        "answers_per_s": round(answered / (end - start), 1),
        "failed": sum(1 for t in done if not t.ok),
        "asked": len(timings),
        "ttft": _percentiles([t.first - t.sent for t in timings if start <= t.sent <= end and t.ok]),
        "front_end_cpu_ms_per_answer": front_ms,
        "loop_thread_cpu_ms_per_answer": round(loop_ms, 3),
        "cpu_ms_per_answer": components,
        "process_cpu_share": round(profile.process_cpu_s / (end - start), 3),
        "loop_thread_busy": round(profile.loop_thread_cpu_s / (end - start), 3),
        "top_self": _top(profile.self_sites, count),
        "top_inclusive": _top(profile.inclusive_sites, count),
        "samples": profile.samples,
    }


def _top(sites: dict[str, float], count: int) -> list[list[Any]]:
    return [[site, round(1000 * s / count, 3)] for site, s in largest(sites, TOP_FRAMES)]


async def _configuration(
    name: str, assets: Assets, settings: Settings, questions: list[str]
) -> dict[str, Any]:
    body: dict[str, object] = {"k": settings.k, "max_tokens": settings.max_tokens}
    if name != "thin":
        body["mode"] = name
    opened = _thin(assets, settings) if name == "thin" else _specrag(assets, settings)
    async with opened as url:
        endpoint = f"{url}/v1/rag"
        duration = settings.warm_s + settings.measure_s + 1
        saturated = _summary(
            *await _window(
                Load(endpoint, questions, body, duration, concurrency=settings.concurrency),
                settings.warm_s,
                settings.measure_s,
            )
        )
        rate = max(1.0, saturated["answers_per_s"] / 2)
        half = _summary(
            *await _window(
                Load(endpoint, questions, body, duration, rate=rate), settings.warm_s, settings.measure_s
            )
        )
    print(_table_row(name, "saturated", saturated))
    print(_table_row(name, f"half ({rate:.0f}/s)", half))
    return {"saturated": saturated, "half_capacity": {"rate": rate, **half}}


def _table_row(name: str, load: str, summary: dict[str, Any]) -> str:
    parts = ", ".join(f"{k} {v}" for k, v in list(summary["cpu_ms_per_answer"].items())[:8])
    return (
        f"{name:7} {load:16} {summary['answers_per_s']:7.1f}/s  ttft p50/p99 "
        f"{summary['ttft']['p50_ms']}/{summary['ttft']['p99_ms']} ms  front end "
        f"{summary['front_end_cpu_ms_per_answer']} ms/answer "
        f"(loop {summary['loop_thread_cpu_ms_per_answer']}): {parts}"
    )


def _draw(results: dict[str, Any], path: Path) -> None:
    names = list(results)
    components = sorted(
        {c for r in results.values() for c in r["saturated"]["cpu_ms_per_answer"] if c != "engine stand-in"}
    )
    figure, axis = plt.subplots(figsize=(8, 4.5))
    bottom = np.zeros(len(names))
    for component in components:
        values = np.array([results[n]["saturated"]["cpu_ms_per_answer"].get(component, 0.0) for n in names])
        axis.bar(names, values, bottom=bottom, label=component)
        bottom += values
    axis.set_ylabel("CPU ms per answer (saturated; simulated engines left out)")
    axis.set_title("specrag's own CPU per answer by component, against a thin front end")
    axis.legend(fontsize=7, ncols=2)
    save_figure(figure, path)


async def _measure(args: argparse.Namespace) -> dict[str, Any]:
    layout = DataLayout(resolve_data_dir(args.data_dir))
    assets = await asyncio.to_thread(
        ensure_assets, layout, backend=data_directory(args.embedder), refuse_other_embedder=True
    )
    window = 5.0 if args.quick else args.measure_s
    settings = Settings(
        args.replicas,
        args.concurrency,
        3.0,
        window,
        args.k,
        args.max_tokens,
        args.prefill_us_per_token,
        args.decode_ms,
    )
    questions = [q.question for q in build_questions(assets.passages, 300)]
    results = {}
    for name in args.configurations.split(","):
        results[name] = await _configuration(name, assets, settings, questions)
    thin = results.get("thin")
    ratios = {
        name: round(r["saturated"]["answers_per_s"] / thin["saturated"]["answers_per_s"], 3)
        for name, r in results.items()
        if thin is not None and name != "thin" and thin["saturated"]["answers_per_s"]
    }
    return {
        "settings": vars(settings),
        "embedder": args.embedder,
        "configurations": results,
        "ratio_vs_thin": ratios,
    }


def main() -> None:
    args = _parser().parse_args()
    logging.basicConfig(level=logging.WARNING)
    data = run_measurement(_measure(args))
    write_json(NAME, data)
    _draw(data["configurations"], plot_path(NAME))
    summary = {
        name: {
            "answers_per_s": r["saturated"]["answers_per_s"],
            "front_end_cpu_ms_per_answer": r["saturated"]["front_end_cpu_ms_per_answer"],
            "ttft_p99_ms_at_half": r["half_capacity"]["ttft"]["p99_ms"],
        }
        for name, r in data["configurations"].items()
    }
    print_summary(
        {"embedder": data["embedder"], **summary, "ratio_vs_thin": data["ratio_vs_thin"]},
        "bench.capacity.profile",
    )


if __name__ == "__main__":
    main()
