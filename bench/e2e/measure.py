"""bench.e2e's measurement: the regime, the traces, every configuration on one engine."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from typing import Any

import numpy as np
from tqdm import tqdm

from bench.common import machine, pin_apart, write_json
from bench.e2e.plan import RATIOS, configurations, run_order
from bench.e2e.report import paired_ratio_ci, plots, summarize
from bench.e2e.runner import (
    RunResult,
    one_search_ms,
    oracle_ttfts,
    run_configuration,
    set_search_ratio,
    ttft_of,
)
from bench.e2e.workload import TraceQuery, generate, load_trace, save_trace
from bench.indexes import scaled_index
from specrag.controller.controller import ControllerConfig
from specrag.paths import DataLayout, resolve_data_dir
from specrag.pipeline.engines.config import parse_cpus
from specrag.pipeline.engines.protocol import Engine
from specrag.pipeline.store.prompt import PromptBuilder
from specrag.retrieval.corpus import Passage
from specrag.retrieval.search.search_runner import SearchRunner
from specrag.retrieval.vector_index import VectorIndex
from specrag.service.run.assembly import ServiceOptions, open_engine, prompt_builder
from specrag.service.run.assets import ensure_assets


async def measure_regime(
    engine: Engine, index: VectorIndex, builder: PromptBuilder, passages: Sequence[Passage], k: int
) -> tuple[dict[float, float], float]:
    """One search's time per ratio, and the cold prefill of a typical prompt, on the same cores."""
    rng = np.random.default_rng(123)
    queries = [passages[int(i)].text[:120] for i in rng.integers(0, len(passages), 12)]
    vectors = np.stack([index.embed_query(q) for q in queries])
    search_ms: dict[float, float] = {}
    for ratio in RATIOS:
        set_search_ratio(index, ratio)
        search_ms[ratio] = await one_search_ms(index, vectors, k)
    cold = []
    for query, vector in zip(queries[:5], vectors[:5], strict=True):
        _, rows = index.search(vector[None, :], k, batch=True)
        prompt = builder.build(sorted({int(r) for r in index.passage_index_of(rows[0]) if r >= 0}), query)
        await engine.reset_prefix_cache()
        cold.append(await ttft_of(engine, prompt.token_ids) * 1000)
    return search_ms, statistics.median(cold)


def load_or_generate_traces(args: argparse.Namespace, passages: Sequence[Passage]) -> list[list[TraceQuery]]:
    """The ``--trace`` file, or one generated trace per seed; ``--save-trace`` writes the first."""
    traces = (
        [load_trace(args.trace)]
        if args.trace is not None
        else [
            generate(passages, args.workload, args.requests, args.rate, cv=args.cv, seed=seed)
            for seed in range(args.seeds)
        ]
    )
    if args.save_trace is not None:
        save_trace(args.save_trace, traces[0])
    return traces


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure every configuration on one engine, write the JSON and the figures; the result."""
    layout = DataLayout(resolve_data_dir())
    assets = ensure_assets(layout, args.model)
    index = scaled_index(layout, assets, args.index_size, args.nlist)
    index.use_runner(SearchRunner(threads=1, cpus=parse_cpus(args.search_cpus, "--search-cpus")))
    run_dir = layout.root / "run" / "e2e"
    options = ServiceOptions(
        engine_urls=(args.engine_url,) if args.engine_url else (),
        eager=args.eager,
        engine_cpus=args.engine_cpus,
    )
    engine_where = (
        args.engine_url or f"in-process vLLM (engine core and model worker) on core(s) {args.engine_cpus}"
    )
    print(
        f"engine: {engine_where}; the service (event loop, vector search) on core(s) {args.search_cpus}; "
        f"tokenizer and store of {assets.model_dir}; "
        f"index {index.searcher.ntotal:,} vectors × {index.dim}, nlist {args.nlist}",
        flush=True,
    )
    try:
        async with open_engine(assets.model_dir, options, run_dir) as (engine, kv_events):
            if args.engine_url is None:
                pinned = pin_apart(
                    parse_cpus(args.engine_cpus, "--engine-cpus"),
                    parse_cpus(args.search_cpus, "--search-cpus"),
                )
                print(f"pinned to core(s) {args.engine_cpus}: {', '.join(pinned)}", flush=True)
            builder = prompt_builder(assets, engine)
            await ttft_of(engine, builder.system_layout_tokens())  # one-off engine warm-up, not measured
            search_ms, cold_prefill_ms = await measure_regime(engine, index, builder, assets.passages, args.k)
            print(
                "one search (ms) by vector search ratio:",
                {f"{r:.1%}": round(v, 1) for r, v in search_ms.items()},
            )
            print(f"cold prefill of a typical k={args.k} prompt: {cold_prefill_ms:.0f} ms", flush=True)
            if args.rate is None:  # a fixed rate overloads a slower engine and idles a faster one
                nearest = min(search_ms, key=lambda ratio: abs(ratio - args.ratio))
                args.rate = args.utilization * 1000 / (search_ms[nearest] + cold_prefill_ms)
                print(f"arrivals: {args.rate:.2f}/s ({args.utilization:.0%} of cold capacity)", flush=True)
            traces = load_or_generate_traces(args, assets.passages)
            base = ControllerConfig(k_max=max(args.k, 10), max_tokens_default=args.max_tokens)
            plan = run_order(configurations(args), len(traces))
            results: dict[tuple[int, str], RunResult] = {}
            for seed, configuration in tqdm(plan, desc="configurations", unit="run"):
                results[(seed, configuration.name)] = await run_configuration(
                    engine,
                    kv_events,
                    index,
                    builder,
                    base,
                    configuration,
                    traces[seed],
                    args.k,
                    args.max_tokens,
                )
            oracle = await oracle_ttfts(engine, results[(0, "serial")].prompts)
    finally:
        index.runner.shutdown()

    oracle_ms = {i: v * 1000 for i, v in oracle.items()}
    idle_ttft_ms = min(r["ttft_ms"] for r in results[(0, "serial")].records if "ttft_ms" in r)
    slo_ms = 5 * idle_ttft_ms
    summaries = {
        f"{name}@seed{seed}": summarize(run, oracle_ms if seed == 0 else {}, slo_ms)
        for (seed, name), run in results.items()
    }
    headline = {}
    for mode in (c.name for c in configurations(args) if c.group == "main" and c.name != "serial"):
        baseline = [r for seed in range(len(traces)) for r in _tag(results[(seed, "serial")].records, seed)]
        other = [r for seed in range(len(traces)) for r in _tag(results[(seed, mode)].records, seed)]
        ratio, low, high = paired_ratio_ci(baseline, other)
        failed = sum("error" in r for r in baseline + other)
        serial_p99, p99 = (summaries[f"{name}@seed0"]["ttft_p99_ms"] for name in ("serial", mode))
        headline[mode] = {
            "ttft_mean_ratio_vs_serial": ratio,
            "ci95": [low, high],
            "ttft_p99_ratio_vs_serial_seed0": p99 / serial_p99,
            "unpaired_errors": failed,
        }
    facts = {
        **machine(),
        "engine_cpus": args.engine_cpus if args.engine_url is None else None,
        "engine_url": args.engine_url,
        "search_cpus": args.search_cpus,
        "model": str(assets.model_dir),
        "index": {"vectors": args.index_size, "dim": index.dim, "nlist": args.nlist, "kind": "ivf-flat"},
        "k": args.k,
        "max_tokens": args.max_tokens,
        "workload": args.workload if args.trace is None else str(args.trace),
        "rate_rps": args.rate,
        "utilization_of_cold_capacity": args.utilization if args.rate_given is None else None,
        "cv": args.cv,
        "requests": args.requests,
        "seeds": len(traces),
        "search_ms_by_ratio": {str(r): v for r, v in search_ms.items()},
        "cold_prefill_ms": cold_prefill_ms,
        "idle_ttft_ms": idle_ttft_ms,
        "slo_ms": slo_ms,
        "run_order": [f"{c.name}@seed{seed}" for seed, c in plan],
    }
    raw = {f"{name}@seed{seed}": run.records for (seed, name), run in results.items()}
    write_json("e2e", {"facts": facts, "summaries": summaries, "headline": headline, "records": raw})
    plots(results, summaries, search_ms, cold_prefill_ms)
    return {"facts": facts, "summaries": summaries, "headline": headline}


def _tag(records: list[dict[str, Any]], seed: int) -> list[dict[str, Any]]:
    """Records of several seeds made pairable: request index → (seed, index)."""
    return [{**r, "i": (seed, r.get("i"))} for r in records]
