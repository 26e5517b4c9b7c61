"""The pgvector backend against the in-process IVF: same vectors, same lists, same probes.

``python -m bench.retrieval.pgvector [--quick]`` starts a throwaway PostgreSQL with pgvector
(:class:`~specrag.retrieval.pgvector.local_server.LocalPostgres`), loads unit vectors drawn
around clusters into it with an IVFFlat index of the list count specrag's IVF build chooses, builds
faiss IVF-Flat of the same lists, and searches both at the same probes. Per query it times the
one-shot query, each stage's query on its own (a stage's database time), and the staged search
in each stage mode (when its first stage and its final stage arrive). The last line printed is
one JSON object: ``pg_final_equals_oneshot`` (share of queries whose staged final top-k equals
the one-shot's: must be 1.0), ``pg_recall_at10`` and ``faiss_recall_at10`` against exact search,
``pg_stage_ms`` (each stage's median latency), ``pg_stage_sum_ratio`` (all stages' database time
over the one-shot's), ``pg_staged_final_latency_ratio`` (when the staged final arrives over a
one-shot query's latency, parallel stages; target <= 1.15), the same for sequential stages, and
``pg_first_stage_ratio`` (when the first running top-k arrives). It is also written to
``bench/out/pgvector.json``. ``pg_overlap_fraction_near_r1`` (bench.pipeline with pgvector as the
retrieval) is not measured here.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from typing import Any

import faiss
import numpy as np

from bench.common import machine, print_summary, write_json
from specrag.retrieval.corpus import Passage
from specrag.retrieval.pgvector.config import PgSettings, StageMode
from specrag.retrieval.pgvector.database import Database
from specrag.retrieval.pgvector.local_server import LocalPostgres
from specrag.retrieval.pgvector.searcher import PgVectorSearcher, stage_probes
from specrag.retrieval.pgvector.table import inspect_table, load_table, read_passages
from specrag.retrieval.staged_ivf import StagedIVF, choose_nlist, default_nprobe
from specrag.retrieval.stages import DEFAULT_STAGES, Schedule, StagePlan
from specrag.retrieval.synthetic import GaussianMixture, queries_near

__all__ = ["main", "measure"]

K = 10
WARMUP = 5


def _recall(found: np.ndarray, exact: np.ndarray) -> float:
    hits = [len(set(row.tolist()) & set(truth.tolist())) / K for row, truth in zip(found, exact, strict=True)]
    return float(np.mean(hits))


def _staged(
    searcher: PgVectorSearcher, query: np.ndarray, plan: StagePlan
) -> tuple[float, float, np.ndarray]:
    """(first stage's arrival s, final stage's arrival s, final ids) of one staged search."""
    started = time.perf_counter()
    first = final = 0.0
    ids = np.empty(0)
    for stage in searcher.stages(query, K, plan):
        now = time.perf_counter() - started
        first = first or now
        if stage.done:
            final, ids = now, stage.ids
    return first, final, ids


def measure(rows: int, dim: int, num_queries: int) -> dict[str, Any]:
    """Load, build and search; the figures the module's docstring names."""
    vectors = GaussianMixture(dim, num_clusters=max(50, rows // 500), seed=1).sample(rows)
    queries = queries_near(vectors, num_queries + WARMUP, seed=2)
    lists = choose_nlist(rows)
    probes = default_nprobe(lists)
    plan = StagePlan(DEFAULT_STAGES["ivf"], Schedule.GEOMETRIC)
    exact = faiss.IndexFlatIP(dim)
    exact.add(vectors)
    _, truth = exact.search(queries, K)
    ivf = StagedIVF.build(vectors, nlist=lists, nprobe=probes)
    _, faiss_ids = ivf.search(queries, K)
    passages = [Passage(f"p{row:07d}", "", str(row)) for row in range(rows)]
    result: dict[str, Any] = {
        "rows": rows,
        "dim": dim,
        "queries": num_queries,
        "lists": lists,
        "probes": probes,
    }
    with LocalPostgres() as server:
        settings = PgSettings(server.dsn, table="bench_vectors", pool_size=4)
        started = time.perf_counter()
        load_table(settings, passages, vectors, nlist=lists)
        result["pg_load_and_index_s"] = round(time.perf_counter() - started, 2)
        database = Database(settings)
        layout = inspect_table(database, dim)
        row_ids = [passage.id for passage in read_passages(database)]
        searcher = PgVectorSearcher(database, layout, row_ids, nprobe=probes)
        stage_counts = stage_probes(plan, probes)
        one_shot, per_stage, equal, pg_ids = [], [], 0, []
        arrivals: dict[str, list[tuple[float, float]]] = {str(mode): [] for mode in StageMode}
        try:
            for number, query in enumerate(queries):
                single = query[None, :]
                started = time.perf_counter()
                _, ids = searcher.search(single, K)
                elapsed = time.perf_counter() - started
                stage_times = []
                for count in stage_counts:
                    searcher.nprobe = count
                    started = time.perf_counter()
                    searcher.search(single, K)
                    stage_times.append(time.perf_counter() - started)
                searcher.nprobe = probes
                timed = {}
                for mode in StageMode:
                    searcher.mode = mode
                    first, final, staged_ids = _staged(searcher, single, plan)
                    timed[str(mode)] = (first, final)
                    if mode is StageMode.PARALLEL and number >= WARMUP:
                        equal += bool(np.array_equal(staged_ids, ids))
                if number < WARMUP:
                    continue
                one_shot.append(elapsed)
                per_stage.append(stage_times)
                pg_ids.append(ids[0])
                for mode_name, pair in timed.items():
                    arrivals[mode_name].append(pair)
        finally:
            searcher.close()
    one_shot_s = statistics.median(one_shot)
    stage_ms = [statistics.median(column) * 1000 for column in zip(*per_stage, strict=True)]
    parallel = arrivals[str(StageMode.PARALLEL)]
    stage_sum_s = float(np.median([sum(times) for times in per_stage]))
    sequential = arrivals[str(StageMode.SEQUENTIAL)]
    result.update(
        {
            "pg_final_equals_oneshot": equal / num_queries,
            "pg_recall_at10": round(_recall(np.stack(pg_ids), truth[WARMUP:]), 4),
            "faiss_recall_at10": round(_recall(faiss_ids[WARMUP:], truth[WARMUP:]), 4),
            "pg_stage_probes": stage_counts,
            "pg_stage_ms": [round(value, 3) for value in stage_ms],
            "pg_oneshot_ms": round(one_shot_s * 1000, 3),
            "pg_stage_sum_ratio": round(stage_sum_s / one_shot_s, 3),
            "pg_staged_final_latency_ratio": round(
                statistics.median(pair[1] for pair in parallel) / one_shot_s, 3
            ),
            "pg_first_stage_ratio": round(statistics.median(pair[0] for pair in parallel) / one_shot_s, 3),
            "pg_sequential_final_latency_ratio": round(
                statistics.median(pair[1] for pair in sequential) / one_shot_s, 3
            ),
            "pg_sequential_first_stage_ratio": round(
                statistics.median(pair[0] for pair in sequential) / one_shot_s, 3
            ),
            "pg_overlap_fraction_near_r1": None,  # needs the engine and bench.pipeline: not measured
            "date": datetime.date.today().isoformat(),
            "machine": machine(),
        }
    )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="20,000 rows x 128 dims, 40 queries (a minute)")
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--queries", type=int, default=100)
    args = parser.parse_args(argv)
    rows, dim, num = (20_000, 128, 40) if args.quick else (args.rows, args.dim, args.queries)
    summary = measure(rows, dim, num)
    write_json("pgvector", summary)
    print_summary(summary, "bench.retrieval.pgvector" + (" --quick" if args.quick else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
