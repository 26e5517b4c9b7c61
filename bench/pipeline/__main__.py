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
near r = 1: an HNSW index (efSearch sets its search time), and a flat IVF index; with
``--pgvector-rows N`` one more, on a PostgreSQL table with pgvector
(:mod:`bench.pipeline.pgvector_point`). Every idle point also runs ``ideal``
(:mod:`bench.pipeline.ideal`): serial's final prompt submitted at the search's start, the bound
as this machine allows it, and each configuration's ``overlap_fraction_of_ideal``; and
``earliest``: serial's final prompt submitted as the first stage of ``all``'s plan holding the
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

Rerun: ``.venv/bin/python -m bench.pipeline --quick`` or without ``--quick`` (more queries, a
12M-vector index, the whole sweep of r); their times here and on a CPU without native bfloat16
are in docs/benchmarks.md, building the padded indexes the first time takes minutes more. Every
point's time grows with the prefill (the calibration sizes the search to it), so ``--quick``
keeps of the idle sweep only the points the figures quote, low r and r near 1, each with as many
queries as before (their intervals unchanged), beside the HNSW, flat and loaded points.

The index sizes are what puts search beside prefill: on the 2-core machine one thread scans the
8M-vector SQ8 index's lists in about as long as the default model prefills one passage (r near
1), and the 12M one reaches r near 2. Writes bench/out/pipeline.json (every per-request
timeline) and pipeline.png; the last line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

from bench.common import machine, plot_path, print_summary, run_measurement, write_json
from bench.indexes import scaled_index
from bench.pipeline.calibration import calibrate, calibration_queries, sweep_points
from bench.pipeline.options import parse_args
from bench.pipeline.pgvector_point import pgvector_point
from bench.pipeline.points import flat_point, graph_point, idle_sweep, loaded_run, open_stack
from bench.pipeline.report import headline, plot
from specrag.paths import DataLayout, resolve_data_dir
from specrag.pipeline.engines.config import parse_cpus
from specrag.retrieval.search.search_runner import SearchRunner
from specrag.retrieval.search.stages import DEFAULT_SCHEDULE, DEFAULT_STAGES
from specrag.service.run.assets import ensure_assets


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
    queries, vectors = calibration_queries(assets.passages, index, args.seed)
    try:
        async with open_stack(args, assets, layout.root / "run" / "pipeline") as stack:
            search_ms, prefill_ms = await calibrate(stack.engine, stack.builder, index, queries, vectors)
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
            pg_summary, pg_runs = await pgvector_point(stack, assets, runner, vectors, prefill_ms, args)
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
        "pgvector_rows": args.pgvector_rows,
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
        **({"pgvector": pg_runs} if pg_runs else {}),
    }
    raw = {key: {name: run.records for name, run in runs.items()} for key, runs in records.items()}
    result = {
        "facts": facts,
        "idle": idle,
        "loaded": loaded,
        "hnsw": hnsw_summary,
        "ivf_flat": flat_summary,
        "pgvector": pg_summary,
    }
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
