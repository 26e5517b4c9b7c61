"""End-to-end RAG latency: the paper's comparisons on the real engine, in one run.

Rerun: ``.venv/bin/python -m bench.e2e --quick`` or without ``--quick`` (the times of both, and
how they grow on a CPU without native bfloat16, are in docs/benchmarks.md). Arrivals come at a
share of the measured cold capacity, so every configuration's wall time grows with the engine's
prefill time: ``--quick`` therefore runs only the headline comparison, serial against ``all``
with serial again as the A/A yardstick, on two traces of 8 requests (4 blocks of 4 for each
interval, so its intervals are wider than the full run's 16 blocks); the full run keeps every
configuration, sweep and 32 requests a trace.
``--model DIR`` runs it on any Hugging Face model directory; ``--trace FILE`` replays a saved
trace (``--save-trace FILE`` writes the generated one). Output: bench/out/e2e.json (every
per-request timeline), e2e_ttft_cdf.png, e2e_ratio_sweep.png, e2e_timelines.png, a table on the
terminal and, as the last line, a JSON summary.

Fair set-up: the engine's model worker and the vector search are pinned to different cores
(``--engine-cpus``, ``--search-cpus``); one untimed pass warms up the engine first; every
configuration starts from an empty prefix cache (confirmed by the engine, see
:mod:`bench.e2e.runner`) and replays the same trace; the main configurations replay two traces
(repetitions), the second in the reverse order of the first, so steady drift of the engine is not
charged to one side (:func:`run_order`), and the order run is recorded. Serial runs twice, at
both ends of the main configurations' list (``serial-repeat``): its ratio in the headline is what
drift and noise alone make of two identical runs, the yardstick for the other ratios. Headline
ratios come with 95 % bootstrap intervals over blocks of consecutive requests of each trace, not
over single requests of one queueing trace; failed requests are counted per configuration beside
its figures.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from bench.common import (
    add_model_option,
    machine,
    pin_apart,
    plot_path,
    print_summary,
    run_measurement,
    write_json,
)
from bench.e2e.report import paired_ratio_ci, plot_ratio_sweep, plot_timeline_strip, plot_ttft_cdf, summarize
from bench.e2e.runner import (
    Configuration,
    RunResult,
    one_search_ms,
    oracle_ttfts,
    run_configuration,
    set_search_ratio,
    ttft_of,
)
from bench.e2e.workload import TraceQuery, generate, load_trace, save_trace
from bench.indexes import scaled_index
from bench.traces import WORKLOADS
from specrag.controller.controller import ControllerConfig
from specrag.controller.modes import MODE_NAMES, get_mode
from specrag.paths import DataLayout, resolve_data_dir
from specrag.pipeline.engines.config import parse_cpus
from specrag.pipeline.engines.protocol import Engine
from specrag.pipeline.models.catalog import DEFAULT_MODEL_NAME
from specrag.pipeline.store.prompt import PromptBuilder
from specrag.retrieval.corpus import Passage
from specrag.retrieval.search_runner import SearchRunner
from specrag.retrieval.vector_index import VectorIndex
from specrag.service.run.assembly import ServiceOptions, open_engine, prompt_builder
from specrag.service.run.assets import ensure_assets

RATIOS = (0.125, 0.25, 0.5, 1.0)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.e2e", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="serial, all and serial again only, 8 requests a trace, a 1M-vector index",
    )
    add_model_option(parser, DEFAULT_MODEL_NAME, "the real model a user runs")
    parser.add_argument("--index-size", type=int, help="vectors in the padded index (default 2M, quick 1M)")
    parser.add_argument("--nlist", type=int, default=1024, help="IVF lists of the padded index")
    parser.add_argument(
        "--ratio", type=float, default=0.5, help="vector search ratio of the main configurations"
    )
    parser.add_argument("-k", type=int, default=6, help="passages per prompt")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens generated per answer")
    parser.add_argument("--requests", type=int, help="queries per configuration (default 32, quick 8)")
    parser.add_argument(
        "--rate", type=float, help="arrivals per second (default: --utilization of the measured capacity)"
    )
    parser.add_argument(
        "--utilization",
        type=float,
        default=0.6,
        help="without --rate: arrivals at this share of one engine's capacity for cold prompts, "
        "1 / (search at --ratio + cold prefill of a typical prompt), both measured at the start",
    )
    parser.add_argument(
        "--cv", type=float, default=1.0, help="inter-arrival coefficient of variation (1 = Poisson)"
    )
    parser.add_argument("--workload", choices=WORKLOADS, default="bursty")
    parser.add_argument(
        "--seeds",
        type=int,
        help="traces for the main configurations, in counterbalanced orders (default 2, also with --quick)",
    )
    parser.add_argument("--trace", type=Path, help="replay this JSONL trace instead of generating one")
    parser.add_argument("--save-trace", type=Path, help="write the generated trace (seed 0) here")
    parser.add_argument("--engine-cpus", default="0", help="core(s) of the engine's model worker")
    parser.add_argument("--search-cpus", default="1", help="core(s) of the vector search thread")
    parser.add_argument("--eager", action="store_true", help="no graph compilation in the engine")
    parser.add_argument(
        "--engine-url",
        help="an OpenAI-compatible server (vLLM with --enable-prompt-tokens-details, SGLang) instead of "
        "the in-process engine; --model must then name its model directory (for the tokenizer)",
    )
    args = parser.parse_args()
    args.rate_given = args.rate
    if args.rate is not None and not args.rate > 0:
        parser.error("--rate must be positive")
    if not 0 < args.utilization < 1:
        parser.error("--utilization must be between 0 and 1")
    args.index_size = args.index_size or (1_000_000 if args.quick else 2_000_000)
    args.requests = args.requests or (QUICK_REQUESTS if args.quick else 32)
    args.seeds = args.seeds or 2
    return args


# The speculating modes again with every speculation launched unpriced (``speculation="always"``,
# the behaviour before the speculation policy), beside their default ``auto``.
ALWAYS = tuple(f"{mode}-always" for mode in MODE_NAMES if get_mode(mode).speculation)
ALWAYS_OVERRIDES = {"speculation": "always"}
SERIAL_REPEAT = "serial-repeat"
# What --quick still answers: does the whole system beat serial end to end, beyond what two
# identical serial runs differ by? Every configuration's time grows with the engine's prefill (the
# arrival rate follows it), so on a float32 engine a quick run can afford about six of them.
QUICK_MODES = ("serial", "all")
QUICK_REQUESTS = 8


def configurations(args: argparse.Namespace) -> list[Configuration]:
    """Every configuration of the run; under ``--quick`` only :data:`QUICK_MODES` and the A/A."""
    modes = QUICK_MODES if args.quick else MODE_NAMES
    main = [Configuration(mode, mode, "main", args.ratio) for mode in modes]
    if not args.quick:
        main += [
            Configuration(
                name, get_mode(name.removesuffix("-always")).name, "main", args.ratio, ALWAYS_OVERRIDES
            )
            for name in ALWAYS
        ]
    # Serial once more after the others: its ratio to the first serial run is what the engine's
    # drift and the trace's noise alone make of "no difference" (an A/A comparison).
    main.append(Configuration(SERIAL_REPEAT, "serial", "main", args.ratio))
    if args.quick:
        return main
    # "exact" is the main "ordering" configuration and "retrieval" order is "serial".
    ordering = [
        Configuration(f"ordering-{p}", "ordering", "ordering", args.ratio, {"ordering_policy": p})
        for p in ("sorted", "greedy", "recency")
    ]
    prefill_bs = [
        Configuration(f"all-mpbs{b}", "all", "max_prefill_bs", args.ratio, {"max_prefill_bs": b})
        for b in (2, 4, 8)
    ]
    stages = [Configuration(f"all-stages{s}", "all", "stages", args.ratio, {"num_stages": s}) for s in (2, 8)]
    ratios = [
        Configuration(f"{mode}-ratio{int(r * 1000) / 10:g}", mode, "ratio", r)
        for r in RATIOS
        if r != args.ratio
        for mode in ("serial", "all")
    ]
    return main + ordering + prefill_bs + stages + ratios


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


def run_order(configurations: Sequence[Configuration], traces: int) -> list[tuple[int, Configuration]]:
    """Every configuration on trace 0, the main ones on the others, in counterbalanced orders.

    An odd trace runs its list backwards (an ABBA design): over each pair of traces every main
    configuration's mean place in the run is the same, so an engine that drifts steadily (warming,
    slowing) shifts every configuration alike and no ratio to serial carries it. Each further pair
    starts one place further along the list, so no configuration always runs first or last.
    """
    plan = []
    for seed in range(traces):
        chosen = [c for c in configurations if seed == 0 or c.group == "main"]
        shift = (seed // 2) % len(chosen)
        rotated = chosen[shift:] + chosen[:shift]
        plan += [(seed, c) for c in (rotated[::-1] if seed % 2 else rotated)]
    return plan


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
    _plots(results, summaries, search_ms, cold_prefill_ms)
    return {"facts": facts, "summaries": summaries, "headline": headline}


def _tag(records: list[dict[str, Any]], seed: int) -> list[dict[str, Any]]:
    """Records of several seeds made pairable: request index → (seed, index)."""
    return [{**r, "i": (seed, r.get("i"))} for r in records]


def _plots(
    results: dict[tuple[int, str], RunResult],
    summaries: dict[str, Any],
    search_ms: dict[float, float],
    cold_ms: float,
) -> None:
    main_runs = [results[(0, mode)] for mode in MODE_NAMES if (0, mode) in results]
    plot_ttft_cdf(main_runs, plot_path("e2e_ttft_cdf"), "TTFT by configuration (seed 0)")
    sweep = [
        s
        for key, s in summaries.items()
        if key.endswith("@seed0") and (s["group"] == "ratio" or s["config"] in ("serial", "all"))
    ]
    plot_ratio_sweep(sweep, search_ms, cold_ms, plot_path("e2e_ratio_sweep"))
    plot_timeline_strip(
        results[(0, "all")].records, plot_path("e2e_timelines"), "Requests of the 'all' configuration"
    )


def print_table(result: dict[str, Any]) -> None:
    columns = (
        "TTFT mean",
        "p50",
        "p99",
        "non-ovl",
        "cached",
        "wasted",
        "spec",
        "adopt",
        "oracle",
        "agree",
        "err",
    )
    header = f"{'configuration':<22}" + "".join(f"{c:>10}" for c in columns)
    print("\n" + header)
    for key, s in result["summaries"].items():
        oracle = "" if s["fraction_of_oracle_ttft"] is None else f"{s['fraction_of_oracle_ttft']:.2f}"
        cells = (
            f"{s['ttft_mean_ms']:.0f}",
            f"{s['ttft_p50_ms']:.0f}",
            f"{s['ttft_p99_ms']:.0f}",
            f"{s['non_overlapped_retrieval_ms_mean']:.1f}",
            f"{s['cached_token_ratio']:.2f}",
            str(s["wasted_spec_prefill_tokens"]),
            str(s["speculations"]),
            f"{s['adopted_fraction']:.2f}",
            oracle,
            f"{s['tree_agreement']:.2f}",
            str(s["errors"]),
        )
        print(f"{key:<22}" + "".join(f"{c:>10}" for c in cells))
    print("\nmean TTFT vs serial (95 % CI):")
    for mode, h in result["headline"].items():
        print(
            f"  {mode:<18} {h['ttft_mean_ratio_vs_serial']:.3f}  [{h['ci95'][0]:.3f}, {h['ci95'][1]:.3f}]"
            f"  p99 {h['ttft_p99_ratio_vs_serial_seed0']:.3f}x"
            f"  ({h['unpaired_errors']} failed requests left out)"
        )
    facts = result["facts"]
    print(
        f"\nengine on core(s) {facts['engine_cpus']}, service and search on core(s) {facts['search_cpus']}; "
        f"search ms by ratio {facts['search_ms_by_ratio']}; cold prefill {facts['cold_prefill_ms']:.0f} ms"
    )


LAST_LINE_KEYS = (
    "ttft_mean_ms",
    "ttft_p50_ms",
    "ttft_p99_ms",
    "embed_ms_mean",
    "non_overlapped_retrieval_ms_mean",
    "non_overlapped_basis",
    "non_overlapped_retrieval_submitted_ms_mean",
    "cached_token_ratio",
    "wasted_spec_prefill_tokens",
    "docs_per_prompt_mean",
    "tree_agreement",
    "tree_agreement_without_prefill_beside",
    "errors",
    "reset_confirmed",
    "first_request_cold",
)


def _rounded(value: Any) -> Any:
    return round(value, 3) if isinstance(value, float) else value


def main() -> None:
    args = parse_args()
    result = run_measurement(run(args))
    print_table(result)
    print(f"wrote {plot_path('e2e_ttft_cdf').parent}/e2e.json and e2e_*.png")
    last: dict[str, Any] = {
        mode: {key: _rounded(result["summaries"][f"{mode}@seed0"][key]) for key in LAST_LINE_KEYS}
        for mode in MODE_NAMES
        if f"{mode}@seed0" in result["summaries"]
    }
    facts = result["facts"]
    # The figures: each configuration's mean TTFT over serial's with its 95 % interval.
    last["headline"] = {
        mode: {
            key: [_rounded(v) for v in value] if isinstance(value, list) else _rounded(value)
            for key, value in figures.items()
        }
        for mode, figures in result["headline"].items()
    }
    last["machine"] = {
        "engine_cpus": facts["engine_cpus"],
        "search_cpus": facts["search_cpus"],
        "model": facts["model"],
        "index": facts["index"],
        "cpus": facts["cpus"],
    }
    print_summary(last)


if __name__ == "__main__":
    main()
