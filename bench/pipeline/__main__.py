"""Where speculative pipelining pays: TTFT against the search-to-prefill ratio r = S / P.

Overlapping the search with the answer's prefill can at best hide the shorter of the two: per
query the **overlap bound** is ``embed + max(search, prefill)``, taken from the serial
configuration's own timeline (prefill = serial TTFT - embed - search). Each configuration's share
of the possible gain is ``overlap_fraction = (serial - config) / (serial - bound)`` over the
means, with a 95 % bootstrap interval over the queries, and ``non_overlapped_over_search`` is its
mean non-overlapped search time over serial's mean search time.

The sweep sets r by the IVF probe share (nprobe) of a padded index and by the prompt size k, chosen
from a calibration of one search per probe share and one prefill per k; r is then *measured* from
the serial run's timelines. At each point, one query at a time (idle), it runs ``serial``,
``speculation`` with equal stages, ``speculation`` with the default schedule and ``all`` (default
schedule); at the point nearest r = 1 the same four also run loaded (Poisson arrivals at
``--utilization`` of the saturation rate measured from the idle serial run). Two more idle points
near r = 1: an HNSW index (efSearch sets its search time), and a flat IVF index. Every idle point
also runs ``ideal`` (:mod:`bench.pipeline.ideal`): serial's final prompt submitted at the search's
start, the bound as this machine allows it, and each configuration's ``overlap_fraction_of_ideal``;
and ``earliest``: serial's final prompt submitted as the first stage of ``all``'s plan holding the
final passages ends, the best any speculation from those stages can do (``earliest-fine``: the
same on a plan of many equal stages), and ``all``'s share of its gain.

The sweep's index has SQ8 lists (``--kind``, one byte a dimension) by default. Search and prefill
share the machine's memory: a flat scan streams four times the bytes and slowed the prefill on
the other core by 17-41 % on the 2-core VM, an SQ8 scan by 2 % (``bench.pipeline.contention``'s
``prefill_beside_ivf`` and ``prefill_beside_ivf-sq8``, two runs), so on flat lists overlap falls
short of the bound for a reason no schedule can remove. The flat point shows it in the same run.

Fair set-up as in bench.e2e: every thread of the engine's processes is pinned to
``--engine-cpus``, the benchmark's own process (event loop and search thread) to
``--search-cpus``, one engine and one trace per figure, a
fresh controller and an emptied prefix cache for every configuration (the first query's cached
prompt tokens are recorded to confirm it).

Rerun: ``.venv/bin/python -m bench.pipeline --quick`` (under 12 minutes on two cores once the
padded indexes exist; building them the first time takes minutes more) or without ``--quick``
(more queries, a 12M-vector index). The index sizes are what puts search beside prefill: on the
2-core machine one thread scans the 8M-vector SQ8 index's lists in about as long as the default
model prefills one passage (r near 1), and the 12M one reaches r near 2. Writes
bench/out/pipeline.json (every per-request timeline) and pipeline.png; the last line printed is
a JSON summary.
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

import numpy as np

from bench.common import (
    add_model_option,
    machine,
    pin_apart,
    plot_path,
    print_summary,
    run_measurement,
    write_json,
)
from bench.e2e.runner import ttft_of
from bench.indexes import scaled_index
from bench.pipeline.calibration import (
    CALIBRATION_QUERIES,
    PREFERRED_K,
    PROMPT_SIZES,
    TARGET_RATIOS,
    calibrate,
    sweep_points,
)
from bench.pipeline.points import Stack, flat_point, graph_point, idle_sweep, loaded_run
from bench.pipeline.report import headline, plot
from specrag.controller.config import ControllerConfig
from specrag.paths import DataLayout, resolve_data_dir
from specrag.pipeline.engines.config import parse_cpus
from specrag.pipeline.models.random_model import RANDOM_MODEL_NAME
from specrag.retrieval.search_runner import SearchRunner
from specrag.retrieval.stages import DEFAULT_SCHEDULE, DEFAULT_STAGES
from specrag.service.run.assembly import ServiceOptions, open_engine, prompt_builder
from specrag.service.run.assets import ensure_assets

# IVF kinds (index_store.KINDS) the sweep can run on.
SWEEP_KINDS = ("ivf-sq8", "ivf", "ivf-pq")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.pipeline", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer queries, an 8M-vector index")
    add_model_option(
        parser, RANDOM_MODEL_NAME, "its size is set per machine so that search and prefill can cost the same"
    )
    parser.add_argument(
        "--kind", choices=SWEEP_KINDS, default="ivf-sq8", help="IVF kind of the sweep's index (lists' codes)"
    )
    parser.add_argument(
        "--index-size", type=int, help="vectors in the sweep's padded IVF index (default 12M, quick 8M)"
    )
    parser.add_argument("--nlist", type=int, default=1024, help="IVF lists of the padded indexes")
    parser.add_argument(
        "--flat-size",
        type=int,
        default=4_000_000,
        help="vectors in the padded flat IVF index of the extra point at r near 1 (0: none)",
    )
    parser.add_argument(
        "--hnsw-size", type=int, default=200_000, help="vectors in the padded HNSW index (0: no HNSW point)"
    )
    parser.add_argument(
        "--targets",
        type=lambda text: tuple(float(value) for value in text.split(",")),
        default=TARGET_RATIOS,
        help="search-to-prefill ratios of the idle sweep, comma-separated (default: %(default)s)",
    )
    parser.add_argument(
        "--idle-queries", type=int, help="queries per idle configuration (default 32, quick 16)"
    )
    parser.add_argument(
        "--loaded-queries", type=int, help="queries per loaded configuration (default 48, quick 20)"
    )
    parser.add_argument(
        "--utilization", type=float, default=0.7, help="loaded arrival rate / saturation rate"
    )
    parser.add_argument("--max-tokens", type=int, default=4, help="tokens generated per answer")
    parser.add_argument(
        "--stages",
        type=int,
        help="stages per search in the speculating configurations (default: the index kind's, "
        + ", ".join(f"{stages} for {kind.upper()}" for kind, stages in DEFAULT_STAGES.items())
        + ")",
    )
    parser.add_argument("--engine-cpus", default="0", help="core(s) of the engine's model worker")
    parser.add_argument("--search-cpus", default="1", help="core(s) of the vector search thread")
    parser.add_argument("--eager", action="store_true", help="no graph compilation in the engine")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    args.index_size = args.index_size or (8_000_000 if args.quick else 12_000_000)
    args.idle_queries = args.idle_queries or (16 if args.quick else 32)
    args.loaded_queries = args.loaded_queries or (20 if args.quick else 48)
    if not 0 < args.utilization < 1:
        parser.error("--utilization must be between 0 and 1")
    return args


async def run(args: argparse.Namespace) -> dict[str, Any]:
    layout = DataLayout(resolve_data_dir())
    assets = ensure_assets(layout, args.model)
    index = scaled_index(layout, assets, args.index_size, args.nlist, args.kind)
    flat = scaled_index(layout, assets, args.flat_size, args.nlist) if args.flat_size else None
    runner = SearchRunner(threads=1, cpus=parse_cpus(args.search_cpus, "--search-cpus"))
    for searched in (index, flat):
        if searched is not None:
            searched.use_runner(runner)
    pinning = (
        f"engine (all threads of its engine-core and model-worker processes) on core(s) {args.engine_cpus}, "
        f"the service (event loop, vector search) on core(s) {args.search_cpus}"
    )
    print(f"{pinning}; {args.kind} index {index.searcher.ntotal:,} vectors, nlist {args.nlist}", flush=True)
    rng = np.random.default_rng(args.seed + 99)
    picks = rng.integers(0, len(assets.passages), CALIBRATION_QUERIES)
    queries = [assets.passages[int(i)].text[:120] for i in picks]
    vectors = np.stack([index.embed_query(q) for q in queries])
    options = ServiceOptions(eager=args.eager, engine_cpus=args.engine_cpus)
    try:
        async with open_engine(assets.model_dir, options, layout.root / "run" / "pipeline") as opened:
            engine, kv_events = opened
            pinned = pin_apart(
                parse_cpus(args.engine_cpus, "--engine-cpus"), parse_cpus(args.search_cpus, "--search-cpus")
            )
            print(f"pinned to core(s) {args.engine_cpus}: {', '.join(pinned)}", flush=True)
            builder = prompt_builder(assets, engine)
            await ttft_of(engine, builder.system_layout_tokens())  # one-off engine warm-up, not measured
            base = ControllerConfig(
                k_default=PREFERRED_K,
                k_max=max(PROMPT_SIZES),
                max_tokens_default=args.max_tokens,
                num_stages=args.stages,
            )
            stack = Stack(engine, kv_events, builder, base, args.max_tokens)
            search_ms, prefill_ms = await calibrate(engine, builder, index, queries, vectors)
            sweep = sweep_points(search_ms, prefill_ms, args.targets)
            idle, idle_runs = await idle_sweep(stack, index, assets.passages, sweep, args)
            nearest_one = min(
                range(len(idle)), key=lambda i: abs(math.log(idle[i]["configurations"]["all"]["ratio"]))
            )
            loaded, loaded_runs = await loaded_run(
                stack,
                index,
                assets.passages,
                sweep[nearest_one],
                idle_runs[nearest_one]["serial"].records,
                args,
            )
            hnsw_summary, hnsw_runs = await graph_point(
                stack, layout, assets, runner, vectors, prefill_ms, args
            )
            flat_summary, flat_runs = await flat_point(
                stack, flat, assets.passages, vectors, prefill_ms, args
            )
    finally:
        runner.shutdown()
    facts = {
        **machine(),
        "pinning": pinning,
        "engine_cpus": args.engine_cpus,
        "search_cpus": args.search_cpus,
        "model": str(assets.model_dir),
        "index": {"vectors": args.index_size, "nlist": args.nlist, "kind": args.kind},
        "flat_vectors": args.flat_size,
        "hnsw_vectors": args.hnsw_size,
        "idle_queries": args.idle_queries,
        "loaded_queries": args.loaded_queries,
        "max_tokens": args.max_tokens,
        "default_schedule": DEFAULT_SCHEDULE,
        "stages": {kind: args.stages or default for kind, default in DEFAULT_STAGES.items()},
        "search_ms_by_probe_share": {str(s): v for s, v in search_ms.items()},
        "prefill_ms_by_k": {str(k): v for k, v in prefill_ms.items()},
    }
    records = {
        **{f"idle-{i}": runs for i, runs in enumerate(idle_runs)},
        "loaded": loaded_runs,
        **({"hnsw": hnsw_runs} if hnsw_runs else {}),
        **({"ivf_flat": flat_runs} if flat_runs else {}),
    }
    raw = {key: {name: run.records for name, run in runs.items()} for key, runs in records.items()}
    result = {"facts": facts, "idle": idle, "loaded": loaded, "hnsw": hnsw_summary, "ivf_flat": flat_summary}
    write_json("pipeline", {**result, "records": raw})
    plot(idle, hnsw_summary, flat_summary, args.kind)
    return result


def main() -> None:
    args = parse_args()
    started = time.perf_counter()
    result = run_measurement(run(args))
    wall_s = time.perf_counter() - started
    print(f"wrote {plot_path('pipeline').parent}/pipeline.json and pipeline.png in {wall_s:.0f} s")
    print_summary(headline(result), "bench.pipeline --quick   (full: drop --quick)")


if __name__ == "__main__":
    main()
