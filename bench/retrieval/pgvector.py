"""The pgvector backend against the in-process IVF: same vectors, same lists, same probes.

``python -m bench.retrieval.pgvector [--quick]`` starts a throwaway PostgreSQL with pgvector
(:class:`~specrag.retrieval.backends.pgvector.local_server.LocalPostgres`), loads unit vectors drawn
around clusters into it with an IVFFlat index of the list count specrag's IVF build chooses, builds
faiss IVF-Flat of the same lists, and searches both at the same probes. Per query it times the
one-shot query, each stage's query on its own (a stage's database time), and the staged search
in each stage mode and choice of stages queried (when its first stage and its final stage
arrive). The last line printed is one JSON object: ``pg_final_equals_oneshot`` (share of queries
whose staged final top-k equals the one-shot's, in every setting: must be 1.0),
``pg_recall_at10`` and ``faiss_recall_at10`` against exact search, ``pg_stage_ms`` (each stage's
median latency), ``pg_stage_sum_ratio`` (every stage's database time over the one-shot's;
``pg_ends_stage_sum_ratio`` the first and final stage's), ``pg_staged_final_latency_ratio``
(when the staged final arrives over a one-shot query's latency, the searcher's default setting;
target <= 1.15), ``pg_first_stage_ratio`` (when the first running top-k arrives),
``pg_round_trip_ms`` (a ``SELECT 1`` on a ready connection: one round trip on this socket) and
``pg_staged_final_floor_ratio`` (a one-shot query and one round trip more, the parallel mode's
export, over the one-shot: the final's floor), ``pg_staged`` (both ratios for every setting), and
the same rows under an HNSW index staged by ``hnsw.ef_search`` (``pg_hnsw_recall_at10`` at each
stage's width, ``pg_hnsw_stages_nested``, ``pg_hnsw_final_equals_oneshot``), and
``pg_overlap_fraction_near_r1``: ``all``'s overlap fraction at bench.pipeline's idle point nearest
r = 1 (r = search / prefill) with a pgvector table as the retrieval
(:mod:`bench.pipeline.pgvector_point`: the real engine, the random-weight model, the engine and
the database on cores of their own), whose figures and phases are under ``pg_pipeline_near_r1``.
``--no-overlap`` skips that point (it starts the engine: minutes). Under ``lexical``: the fused
hybrid's recall@1/5/10 with each lexical channel, ``--pg-lexical fts`` and ``bm25``, on
bench.retrieval's evaluation sets, and each channel's latency (:mod:`bench.retrieval.pgvector_lexical`).
It is also written to ``bench/out/pgvector.json``, the lexical comparison drawn in
``bench/out/pgvector.png``.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import shlex
import statistics
import time
from typing import Any

import faiss
import numpy as np

from bench.common import plot_path, print_summary, write_json
from bench.pipeline.pgvector_point import measure_overlap
from bench.retrieval.pgvector_lexical import draw_lexical, measure_lexical
from specrag.retrieval.backends.local.staged_ivf import StagedIVF, choose_nlist, default_nprobe
from specrag.retrieval.backends.pgvector.config import DEFAULT_STAGE_MODE, PgSettings, StageMode, StageQueries
from specrag.retrieval.backends.pgvector.database import Database
from specrag.retrieval.backends.pgvector.local_server import LocalPostgres
from specrag.retrieval.backends.pgvector.queries import fetched
from specrag.retrieval.backends.pgvector.searcher import PgVectorSearcher, stage_probes
from specrag.retrieval.backends.pgvector.table import inspect_table, load_table, read_passages
from specrag.retrieval.corpus import Passage
from specrag.retrieval.search.stages import DEFAULT_STAGES, Schedule, StagePlan
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


# The staged settings measured: (stage mode, stages queried); the first is the searcher's default.
DEFAULT_SETTING = (DEFAULT_STAGE_MODE, StageQueries.ENDS)
SETTINGS = [DEFAULT_SETTING, *((m, q) for q in StageQueries for m in StageMode if (m, q) != DEFAULT_SETTING)]


def _setting_name(mode: StageMode, queried: StageQueries) -> str:
    return f"{mode}/{queried}"


def _round_trip_s(database: Database, count: int) -> float:
    """The median time of ``SELECT 1`` on a connection held ready: the floor of one round trip."""
    timings = []
    with database.connection() as connection:
        for _ in range(count):
            started = time.perf_counter()
            connection.execute("SELECT 1").fetchone()
            timings.append(time.perf_counter() - started)
    return statistics.median(timings)


def measure_hnsw(
    server: LocalPostgres,
    passages: list[Passage],
    vectors: np.ndarray,
    queries: np.ndarray,
    truth: np.ndarray,
    plan: StagePlan,
) -> dict[str, Any]:
    """The same rows under an HNSW index, staged by a growing ``hnsw.ef_search``: recall@10 at each
    stage's width, the share of queries whose stages nested (no rank's score worse than at the
    stage before: not guaranteed on HNSW) and whose final stage equals a one-shot query."""
    settings = PgSettings(server.dsn, table="bench_vectors_hnsw", pool_size=4)
    started = time.perf_counter()
    load_table(settings, passages, vectors, index_method="hnsw")
    load_s = time.perf_counter() - started
    database = Database(settings)
    layout = inspect_table(database, vectors.shape[1])
    searcher = PgVectorSearcher(
        database, layout, [passage.id for passage in passages], queried=StageQueries.EVERY
    )
    # Each stage's hnsw.ef_search: at least the rows a query asks for (queries.fetched).
    widths = [max(fetched(K), width) for width in stage_probes(plan, searcher.nprobe, StageQueries.EVERY)]
    found: list[list[np.ndarray]] = [[] for _ in widths]
    nested = equal = 0
    try:
        for query in queries:
            single = query[None, :]
            stages = list(searcher.stages(single, K, plan))
            _, one_shot = searcher.search(single, K)
            equal += bool(np.array_equal(stages[-1].ids, one_shot))
            nested += all(
                (after.distances >= before.distances - 1e-6).all()
                for before, after in itertools.pairwise(stages)
            )
            for number, stage in enumerate(stages):
                found[number].append(stage.ids[0])
    finally:
        searcher.close()
    return {
        "pg_hnsw_load_and_index_s": round(load_s, 2),
        "pg_hnsw_ef_search": widths,
        "pg_hnsw_recall_at10": [round(_recall(np.stack(ids), truth), 4) for ids in found],
        "pg_hnsw_stages_nested": nested / len(queries),
        "pg_hnsw_final_equals_oneshot": equal / len(queries),
    }


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
        every_stage = stage_probes(plan, probes, StageQueries.EVERY)
        one_shot, per_stage, pg_ids = [], [], []
        equal = dict.fromkeys(SETTINGS, 0)
        arrivals: dict[tuple[StageMode, StageQueries], list[tuple[float, float]]] = {s: [] for s in SETTINGS}
        try:
            round_trip_s = _round_trip_s(database, 200)
            for number, query in enumerate(queries):
                single = query[None, :]
                # Untimed: the query's lists are brought in first, as they are for the stages and
                # staged searches timed after the one-shot (else the one-shot alone pays for it).
                searcher.search(single, K)
                started = time.perf_counter()
                _, ids = searcher.search(single, K)
                elapsed = time.perf_counter() - started
                stage_times = []
                for count in every_stage:
                    searcher.nprobe = count
                    started = time.perf_counter()
                    searcher.search(single, K)
                    stage_times.append(time.perf_counter() - started)
                searcher.nprobe = probes
                timed = {}
                for setting in SETTINGS:
                    searcher.mode, searcher.queried = setting
                    first, final, staged_ids = _staged(searcher, single, plan)
                    timed[setting] = (first, final)
                    if number >= WARMUP:
                        equal[setting] += bool(np.array_equal(staged_ids, ids))
                if number < WARMUP:
                    continue
                one_shot.append(elapsed)
                per_stage.append(stage_times)
                pg_ids.append(ids[0])
                for setting, pair in timed.items():
                    arrivals[setting].append(pair)
        finally:
            searcher.close()
        result.update(measure_hnsw(server, passages, vectors, queries[WARMUP:], truth[WARMUP:], plan))
    one_shot_s = statistics.median(one_shot)
    stage_ms = [statistics.median(column) * 1000 for column in zip(*per_stage, strict=True)]
    stage_sum_s = float(np.median([sum(times) for times in per_stage]))
    ends_sum_s = float(np.median([times[0] + times[-1] for times in per_stage]))

    def ratio(setting: tuple[StageMode, StageQueries], which: int) -> float:
        return round(statistics.median(pair[which] for pair in arrivals[setting]) / one_shot_s, 3)

    default = DEFAULT_SETTING
    result.update(
        {
            "pg_final_equals_oneshot": min(equal.values()) / num_queries,
            "pg_recall_at10": round(_recall(np.stack(pg_ids), truth[WARMUP:]), 4),
            "faiss_recall_at10": round(_recall(faiss_ids[WARMUP:], truth[WARMUP:]), 4),
            "pg_stage_probes": every_stage,
            "pg_stage_ms": [round(value, 3) for value in stage_ms],
            "pg_oneshot_ms": round(one_shot_s * 1000, 3),
            "pg_round_trip_ms": round(round_trip_s * 1000, 3),
            "pg_stage_sum_ratio": round(stage_sum_s / one_shot_s, 3),
            "pg_ends_stage_sum_ratio": round(ends_sum_s / one_shot_s, 3),
            "pg_default_stages": _setting_name(*default),
            "pg_staged_final_latency_ratio": ratio(default, 1),
            "pg_first_stage_ratio": ratio(default, 0),
            # The parallel mode's final query waits for the export's round trip at least.
            "pg_staged_final_floor_ratio": round((one_shot_s + round_trip_s) / one_shot_s, 3),
            "pg_staged": {
                _setting_name(*setting): {
                    "final_latency_ratio": ratio(setting, 1),
                    "first_stage_ratio": ratio(setting, 0),
                    "final_equals_oneshot": equal[setting] / num_queries,
                }
                for setting in SETTINGS
            },
            "date": datetime.date.today().isoformat(),
        }
    )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="20,000 rows x 128 dims, 40 queries, the overlap point's --quick"
    )
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--queries", type=int, default=100)
    parser.add_argument(
        "--no-overlap",
        action="store_true",
        help="skip pg_overlap_fraction_near_r1 (bench.pipeline's point: it starts the engine, minutes)",
    )
    parser.add_argument(
        "--pipeline-options",
        default="",
        help="bench.pipeline options for the overlap point, e.g. '--pg-stage-mode sequential'",
    )
    args = parser.parse_args(argv)
    rows, dim, num = (20_000, 128, 40) if args.quick else (args.rows, args.dim, args.queries)
    summary = measure(rows, dim, num)
    near_r1 = None
    if not args.no_overlap:
        near_r1 = measure_overlap([*(["--quick"] if args.quick else []), *shlex.split(args.pipeline_options)])
    summary["pg_overlap_fraction_near_r1"] = None if near_r1 is None else near_r1["overlap_fraction"]
    summary["pg_pipeline_near_r1"] = near_r1
    summary["lexical"] = measure_lexical(args.quick)
    write_json("pgvector", summary)
    draw_lexical(summary["lexical"], plot_path("pgvector"))
    print_summary(summary, "bench.retrieval.pgvector" + (" --quick" if args.quick else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
