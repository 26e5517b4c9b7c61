"""bench.pipeline's idle point nearest r = 1 with a pgvector table as the retrieval.

The corpus's vectors, padded with synthetic rows as the sweep's index is
(:func:`~specrag.retrieval.synthetic.pad_with_synthetic`), are loaded into a throwaway PostgreSQL
(:class:`~specrag.retrieval.backends.pgvector.local_server.LocalPostgres`) with an IVFFlat index of the
lists specrag's IVF build chooses. The server's processes are pinned to ``--search-cpus``, where
the in-process search runs in the other points, so the engine keeps its core(s) to itself and
the comparison with those points is of the backend, not of the cores it may use. The table is
measured by the flat-IVF point's own runner (:func:`~bench.pipeline.points.ivf_point_near_one`,
the backend a parameter): one search per probe share, the pair nearest r = 1, then every
configuration and bound of an idle point, with the BM25 channel of the corpus's index fused in,
as ``serve --backend pgvector`` does.

Each stage of a pgvector search is a whole query at more probes (docs/backends.md), so a staged
search costs the database more than a one-shot one; with one search core the parallel stage mode
runs its two connections on that one core. ``--pg-stage-mode`` chooses the mode measured.

``python -m bench.pipeline.pgvector_point --quick`` runs this point alone (the engine, the
calibration of the prefill per prompt size, the point); ``bench.retrieval.pgvector`` calls
:func:`measure_overlap` for its ``pg_overlap_fraction_near_r1``, and ``bench.pipeline
--pgvector-rows N`` adds the point to a whole sweep.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections.abc import Collection, Iterator
from typing import Any

import numpy as np
import psutil

from bench.common import machine, print_summary, run_measurement, write_json
from bench.e2e.runner import RunResult
from bench.pipeline.calibration import (
    calibration_queries,
    on_searcher,
    prefill_ms_by_k,
)
from bench.pipeline.options import parse_args
from bench.pipeline.points import Stack, ivf_point_near_one, open_stack
from bench.pipeline.report import extra_point
from specrag.paths import DataLayout, resolve_data_dir
from specrag.pipeline.engines.config import parse_cpus
from specrag.retrieval.backends.pgvector.config import PgSettings
from specrag.retrieval.backends.pgvector.database import Database
from specrag.retrieval.backends.pgvector.local_server import LocalPostgres
from specrag.retrieval.backends.pgvector.searcher import PgVectorSearcher
from specrag.retrieval.backends.pgvector.table import load_table
from specrag.retrieval.corpus import Passage
from specrag.retrieval.search.search_runner import SearchRunner
from specrag.retrieval.search.stages import DEFAULT_STAGES
from specrag.retrieval.synthetic import pad_with_synthetic
from specrag.retrieval.vector_index import VectorIndex
from specrag.service.run.assets import Assets, ensure_assets

__all__ = ["QUICK_ROWS", "measure_overlap", "padded_table", "pgvector_point", "pin_server"]

# Rows of the --quick table: with every list probed, one search of them on one core takes about
# a one-passage prefill of the random model, so the sweep of probe shares reaches r near 1.
QUICK_ROWS = 300_000
_TABLE = "bench_pipeline_passages"


def pin_server(server: LocalPostgres, cpus: Collection[int]) -> int:
    """The server's postmaster and its processes on ``cpus``; the backends it forks later inherit
    the mask. Returns how many processes were pinned."""
    postmaster = psutil.Process(int((server.data / "postmaster.pid").read_text().split()[0]))
    processes = [postmaster, *postmaster.children(recursive=True)]
    for process in processes:
        process.cpu_affinity(sorted(cpus))
    return len(processes)


@contextlib.contextmanager
def padded_table(
    server: LocalPostgres, index: VectorIndex, rows: int, args: argparse.Namespace
) -> Iterator[VectorIndex]:
    """``index``'s vectors padded to ``rows`` in a table on ``server``, searched as a
    :class:`VectorIndex` with ``index``'s passages, embedder and BM25 channel (closed on exit),
    staged as ``args.pg_stage_mode`` and ``args.pg_stages`` say."""
    searcher: Any = index.searcher  # the corpus's flat IVF index, which holds the vectors themselves
    held = searcher.ntotal
    stored, real = searcher.stored_vectors(np.ones(held, dtype=bool))
    vectors, sources = pad_with_synthetic(real[np.argsort(stored)], max(rows, held), seed=args.seed)
    ids = [*index.passage_ids, *(f"~synthetic-{row:08d}" for row in range(len(sources)))]
    settings = PgSettings(server.dsn, table=_TABLE, pool_size=4)
    started = time.perf_counter()
    layout = load_table(settings, [Passage(name, "", "") for name in ids], vectors, replace=True)
    print(f"pgvector table of {len(ids):,} rows loaded and indexed in {time.perf_counter() - started:.0f} s")
    table = PgVectorSearcher(
        Database(settings), layout, ids, nprobe=layout.lists, mode=args.pg_stage_mode, queried=args.pg_stages
    )
    try:
        yield on_searcher(index, table, sources, DEFAULT_STAGES["ivf"])
    finally:
        table.close()


async def pgvector_point(
    stack: Stack,
    assets: Assets,
    runner: SearchRunner,
    vectors: np.ndarray,
    prefill_ms: dict[int, float],
    args: argparse.Namespace,
) -> tuple[dict[str, Any] | None, dict[str, RunResult]]:
    """The idle point nearest r = 1 on a pgvector table of ``args.pgvector_rows`` rows (none at 0)."""
    if not args.pgvector_rows:
        return None, {}
    with LocalPostgres() as server:
        pinned = pin_server(server, parse_cpus(args.search_cpus, "--search-cpus"))
        print(f"PostgreSQL ({pinned} processes) pinned to core(s) {args.search_cpus}", flush=True)
        with padded_table(server, assets.index, args.pgvector_rows, args) as table:
            table.use_runner(runner)
            label = f"idle, pgvector ({args.pg_stage_mode} stages, {args.pg_stages} queried)"
            summary, runs = await ivf_point_near_one(
                stack, table, assets.passages, vectors, prefill_ms, args, args.seed + 90, label
            )
    summary["backend"] = {**table.searcher.settings, "rows": table.searcher.ntotal, "table": _TABLE}
    return summary, runs


async def _measure(args: argparse.Namespace) -> dict[str, Any]:
    layout = DataLayout(resolve_data_dir())
    assets = ensure_assets(layout, args.model)
    runner = SearchRunner(threads=1, cpus=parse_cpus(args.search_cpus, "--search-cpus"))
    assets.index.use_runner(runner)
    queries, vectors = calibration_queries(assets.passages, assets.index, args.seed)
    try:
        async with open_stack(args, assets, layout.root / "run" / "pipeline-pgvector") as stack:
            prefill_ms = await prefill_ms_by_k(stack.engine, assets.index, stack.builder, queries, vectors)
            print("prefill (ms) by k, system prompt cached:", {k: round(v, 1) for k, v in prefill_ms.items()})
            summary, _ = await pgvector_point(stack, assets, runner, vectors, prefill_ms, args)
    finally:
        runner.shutdown()
    assert summary is not None
    return {
        **extra_point(summary),
        "k": summary["k"],
        "probe_share": summary["knob"],
        "backend": summary["backend"],
        "prefill_ms_by_k": {str(k): round(v, 1) for k, v in prefill_ms.items()},
        "engine_cpus": args.engine_cpus,
        "search_cpus": args.search_cpus,
        "idle_queries": args.idle_queries,
    }


def measure_overlap(argv: list[str]) -> dict[str, Any]:
    """The point alone, with bench.pipeline's options ``argv``: ``all``'s figures at it
    (:func:`~bench.pipeline.report.extra_point`: r, overlap fraction, the phases)."""
    args = parse_args(argv)
    args.pgvector_rows = args.pgvector_rows or QUICK_ROWS
    return run_measurement(_measure(args))


def main() -> None:
    summary = measure_overlap(sys.argv[1:])
    write_json("pipeline-pgvector", {**summary, "machine": machine()})
    print_summary(summary, "bench.pipeline.pgvector_point")


if __name__ == "__main__":
    main()
