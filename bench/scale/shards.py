"""The sharded index on Ray: exact merge, merge overhead, latency, memory, a kill, and a projection.

``python -m bench.scale.shards [--quick]`` builds one corpus of synthetic unit vectors as an
unsharded SQ8 IVF index (searched in this process) and as 1, 2 and 4 shards sharing its quantizer,
each shard a Ray actor of a local Ray instance on this machine (no engine: retrieval only), and runs
the same single-query staged searches (the service's default plan) through each:

- ``final_equal_unsharded``: the share of queries whose merged final top-k equals the unsharded
  index's (ids and distances; 1.0 by construction, checked);
- ``hnsw_merged_recall_at10``: HNSW shards (one graph each, in this process) merged, against one
  graph over the same vectors at the same ``efSearch``;
- ``merge_overhead_ms``: what merging the shards' running top-k costs per stage (p50, p99), and
  the search's p50/p99 (bootstrap 95 % intervals) against the in-process unsharded index;
- ``memory_per_shard_mib``: each shard actor's resident memory (its lists memory-mapped);
- ``kill``: one shard actor of four killed under a stream of queries; ``wrong_answers`` (must be 0),
  ``failed`` (queries refused naming the shard) and ``recovery_s`` (the kill to the next answer);
- ``simulated``: the measured costs (per code scanned, per centroid, per stage's round trip, the
  merge per shard) projected to 10⁸ and 10⁹ vectors over 8 to 64 nodes, one shard a node:
  search p50/p99, the merge's share, and ``r`` = search / prefill against an assumed prefill
  (:data:`PREFILL_MS_8B_GPU`, how it is derived is written beside it).

The figures of a shared machine are noisy: compare the configurations of one run, not runs. The
JSON goes to ``bench/out/scale_shards.json``, the plot to ``bench/out/scale_shards.png``.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import psutil
import ray

from bench.common import percentile_ci, plot_path, print_summary, save_figure, write_json
from specrag.errors import ShardUnavailableError
from specrag.retrieval.backends.local.staged_ivf import StagedIVF
from specrag.retrieval.backends.shards.build import build_hnsw_shards, build_ivf_shards
from specrag.retrieval.backends.shards.merge import MergedCursor, ShardedSearcher
from specrag.retrieval.backends.shards.search_actors import RemoteShard, search_shards
from specrag.retrieval.backends.shards.store import save_shards
from specrag.retrieval.search.stages import StagePlan, run_stages, stage_plan
from specrag.retrieval.synthetic import GaussianMixture, queries_near

K = 10
SHARD_COUNTS = (1, 2, 4)
# The prefill the projection's r divides by: a 2,000-token prompt (five passages and a question)
# on an 8B model on one H100, at 2 × 8e9 FLOP a token and 40 % of its 989 dense bf16 TFLOP/s:
# 2000 × 1.6e10 / (0.4 × 9.89e14) s ≈ 81 ms. An assumption from the GPU's data sheet, not measured.
PREFILL_MS_8B_GPU = 81.0
# The projected index: lists per corpus size (faiss's guidance for 10⁸-10⁹ vectors), lists probed.
PROJECTED_LISTS = {100_000_000: 1 << 16, 1_000_000_000: 1 << 18}
PROJECTED_NPROBE = 128
PROJECTED_NODES = (8, 16, 32, 64)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="a small corpus and few queries (minutes)")
    parser.add_argument("--vectors", type=int, help="corpus size (default 60k quick, 500k full)")
    parser.add_argument("--queries", type=int, help="queries per configuration (default 100 quick, 400 full)")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--nlist", type=int, default=1024, help="IVF lists (capped at vectors/39)")
    parser.add_argument("--nprobe", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.vectors = args.vectors or (60_000 if args.quick else 500_000)
    args.queries = args.queries or (100 if args.quick else 400)
    return args


def quantiles(values: Sequence[float], rng: np.random.Generator) -> dict[str, Any]:
    """p50 and p99 of ``values`` with their bootstrap intervals."""
    array = np.asarray(values, dtype=np.float64)
    return {
        "p50": float(np.percentile(array, 50)),
        "p50_ci": percentile_ci(array, 50, rng),
        "p99": float(np.percentile(array, 99)),
        "p99_ci": percentile_ci(array, 99, rng),
    }


def timed_stages(
    open_cursor: Callable[[np.ndarray], Any], expected_units: int, query: np.ndarray, plan: StagePlan
) -> tuple[float, np.ndarray, np.ndarray, list[float]]:
    """One staged search to its end: milliseconds, final (distances, ids), merge ms per stage."""
    started = time.perf_counter()
    cursor = open_cursor(query)
    stages = list(run_stages(cursor.advance, cursor.snapshot, plan, expected_units, started=started))
    elapsed_ms = (time.perf_counter() - started) * 1000
    merges = [seconds * 1000 for seconds in cursor.merge_s] if isinstance(cursor, MergedCursor) else []
    return elapsed_ms, stages[-1].distances[0], stages[-1].ids[0], merges


def unsharded_run(whole: StagedIVF, queries: np.ndarray, plan: StagePlan) -> dict[str, Any]:
    results = [
        timed_stages(lambda q: whole.cursor(q, K), whole.expected_units, query, plan) for query in queries
    ]
    return {
        "ms": [ms for ms, _, _, _ in results],
        "distances": [d for _, d, _, _ in results],
        "ids": [i for _, _, i, _ in results],
    }


def sharded_run(
    remote: ShardedSearcher, queries: np.ndarray, plan: StagePlan, truth: dict[str, Any]
) -> dict[str, Any]:
    results = [
        timed_stages(lambda q: remote.cursor(q, K), remote.expected_units, query, plan) for query in queries
    ]
    equal = [
        np.array_equal(ids, truth_ids) and np.array_equal(distances, truth_distances)
        for (_, distances, ids, _), truth_ids, truth_distances in zip(
            results, truth["ids"], truth["distances"], strict=True
        )
    ]
    stages = max(len(merges) for _, _, _, merges in results)
    per_stage = [[merges[s] for _, _, _, merges in results if len(merges) > s] for s in range(stages)]
    memory = [
        psutil.Process(shard.info.pid).memory_info().rss / 2**20
        for shard in remote.shards
        if isinstance(shard, RemoteShard)
    ]
    return {
        "ms": [ms for ms, _, _, _ in results],
        "equal_share": float(np.mean(equal)),
        "merge_ms_by_stage": per_stage,
        "memory_per_shard_mib": [round(mib, 1) for mib in memory],
    }


def kill_run(
    remote: ShardedSearcher, queries: np.ndarray, truth_ids: list[np.ndarray], plan: StagePlan
) -> dict[str, Any]:
    """Queries in a stream; shard 1 killed after a second; counted until 30 queries that started
    after the kill are answered. ``recovery_s`` runs from the kill to the end of the first of
    them (it needed the restarted shard from its first stage)."""
    answers: list[tuple[int, np.ndarray, float, float]] = []
    failed: list[str] = []
    stop = threading.Event()

    def stream() -> None:
        number = 0
        while not stop.is_set():
            row, started = number % len(queries), time.monotonic()
            try:
                final = list(remote.stages(queries[row], K, plan))[-1]
                answers.append((row, final.ids[0], started, time.monotonic()))
            except ShardUnavailableError as error:
                failed.append(str(error))
            number += 1

    worker = threading.Thread(target=stream)
    worker.start()
    try:
        time.sleep(1.0)
        victim = remote.shards[1]
        assert isinstance(victim, RemoteShard)
        killed_at = time.monotonic()
        victim.kill()
        deadline = killed_at + 120
        while time.monotonic() < deadline and sum(began > killed_at for _, _, began, _ in answers) < 30:
            time.sleep(0.05)
    finally:
        stop.set()
        worker.join(timeout=120)
    after = [ended for _, _, began, ended in answers if began > killed_at]
    return {
        "queries": len(answers) + len(failed),
        "wrong_answers": sum(not np.array_equal(ids, truth_ids[row]) for row, ids, _, _ in answers),
        "failed": len(failed),
        "recovery_s": round(min(after) - killed_at, 3) if after else None,
    }


def hnsw_recall(args: argparse.Namespace, queries: np.ndarray, rng_seed: int) -> dict[str, float]:
    """Merged recall@10 of 2 and 4 HNSW shards against one graph over the same vectors."""
    from specrag.retrieval.backends.local.staged_hnsw import StagedHNSW

    count = min(args.vectors, 20_000)
    vectors = GaussianMixture(args.dim, num_clusters=50, seed=rng_seed).sample(count)
    near = queries_near(vectors, len(queries), seed=rng_seed + 1)
    one = StagedHNSW.build(vectors, m=16, ef_search=64)
    _, truth = one.search(near, K)
    recall = {}
    for shards in (2, 4):
        _, found = build_hnsw_shards(vectors, shards, m=16, ef_search=64).search(near, K)
        recall[str(shards)] = float(
            np.mean([len(set(a) & set(b)) / K for a, b in zip(found, truth, strict=True)])
        )
    return recall


def measured_costs(whole: StagedIVF, queries: np.ndarray, result: dict[str, Any]) -> dict[str, float]:
    """The unit costs the projection scales: per code scanned, per centroid, per stage's round
    trip to the shard actors, and the merge's fixed and per-shard parts (a line through the
    per-stage merge p50 at 1, 2 and 4 shards)."""
    quantizer: Any = whole.index.quantizer
    started = time.perf_counter()
    quantizer.search(queries, whole.nprobe)
    centroid_ns = (time.perf_counter() - started) / len(queries) / whole.index.nlist * 1e9
    scanned = whole.nprobe * whole.ntotal / whole.index.nlist
    unsharded_p50 = result["unsharded"]["p50"]
    code_ns = max(unsharded_p50 * 1e6 - centroid_ns * whole.index.nlist, 0.0) / scanned
    stages = len(result["merge_overhead_ms"]["1"]["by_stage"])
    round_trip_ms = max(result["search_ms"]["1"]["p50"] - unsharded_p50, 0.0) / stages
    counts = np.array([float(s) for s in SHARD_COUNTS])
    merges = np.array(
        [np.median([s["p50"] for s in result["merge_overhead_ms"][str(n)]["by_stage"]]) for n in SHARD_COUNTS]
    )
    slope, intercept = np.polyfit(counts, merges, 1)
    four = result["search_ms"]["4"]
    return {
        "code_ns": code_ns,
        "centroid_ns": centroid_ns,
        "stage_round_trip_ms": round_trip_ms,
        "merge_ms_fixed": float(max(intercept, 0.0)),
        "merge_ms_per_shard": float(max(slope, 0.0)),
        "tail_p99_over_p50": four["p99"] / four["p50"],
        "stages": float(stages),
    }


def project(costs: dict[str, float], dim: int) -> dict[str, Any]:
    """Search p50/p99, the merge's share and r at 10⁸ and 10⁹ vectors over 8-64 nodes (module doc)."""
    projected: dict[str, Any] = {}
    for vectors, lists in PROJECTED_LISTS.items():
        rows = {}
        for nodes in PROJECTED_NODES:
            quantizer_ms = lists * costs["centroid_ns"] / 1e6
            scan_ms = PROJECTED_NPROBE * vectors / lists / nodes * costs["code_ns"] / 1e6
            merge_ms = costs["stages"] * (costs["merge_ms_fixed"] + costs["merge_ms_per_shard"] * nodes)
            trips_ms = costs["stages"] * costs["stage_round_trip_ms"]
            p50 = quantizer_ms + scan_ms + merge_ms + trips_ms
            p99 = quantizer_ms + scan_ms * costs["tail_p99_over_p50"] + merge_ms + trips_ms
            rows[str(nodes)] = {
                "search_ms_p50": round(p50, 2),
                "search_ms_p99": round(p99, 2),
                "merge_share": round(merge_ms / p50, 3),
                "r": round(p50 / PREFILL_MS_8B_GPU, 3),
                "sq8_gib_per_node": round(vectors * (dim + 8) / nodes / 2**30, 1),  # a code and an id a row
            }
        projected[f"{vectors:.0e}"] = {"nlist": lists, "nprobe": PROJECTED_NPROBE, "nodes": rows}
    return {"prefill_ms_assumed": PREFILL_MS_8B_GPU, "costs": costs, "projected": projected}


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt

    figure, (latency, merge) = plt.subplots(1, 2, figsize=(10, 4))
    names = ["unsharded", *(f"{n} shard{'s' if n > 1 else ''}" for n in SHARD_COUNTS)]
    runs = [result["unsharded"], *(result["search_ms"][str(n)] for n in SHARD_COUNTS)]
    latency.bar(names, [run["p50"] for run in runs], label="p50")
    latency.scatter(names, [run["p99"] for run in runs], color="black", marker="_", s=400, label="p99")
    latency.set_ylabel("staged search, ms (Ray local, shared 2-core machine)")
    latency.legend()
    for count in SHARD_COUNTS:
        stages = result["merge_overhead_ms"][str(count)]["by_stage"]
        merge.plot(range(1, len(stages) + 1), [s["p50"] for s in stages], marker="o", label=f"{count} shards")
    merge.set_xlabel("stage")
    merge.set_ylabel("merge of the running top-k, ms (p50)")
    merge.legend()
    save_figure(figure, path)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    # Single-query searches, as the service's search thread runs them (one faiss thread): OpenMP
    # threads only wait for each other on a query's slice, and spin on a loaded machine.
    faiss.omp_set_num_threads(1)
    rng = np.random.default_rng(args.seed)
    vectors = GaussianMixture(args.dim, num_clusters=200, seed=args.seed).sample(args.vectors)
    queries = queries_near(vectors, args.queries, seed=args.seed + 1)
    plan = stage_plan("ivf")
    whole = StagedIVF.build(vectors, nlist=args.nlist, nprobe=args.nprobe, codes="sq8", seed=args.seed)
    truth = unsharded_run(whole, queries, plan)
    result: dict[str, Any] = {
        "unsharded": quantiles(truth["ms"], rng),
        "search_ms": {},
        "merge_overhead_ms": {},
        "memory_per_shard_mib": {},
        "final_equal_unsharded": {},
    }
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory() as scratch:
            for count in SHARD_COUNTS:
                directory = Path(scratch) / f"shards-{count}"
                local = build_ivf_shards(
                    vectors, count, nlist=args.nlist, nprobe=args.nprobe, codes="sq8", seed=args.seed
                )
                save_shards(local, directory)
                with search_shards(directory, local.settings, num_cpus=2 / count) as remote:
                    run = sharded_run(remote, queries, plan, truth)
                    if count == 4:
                        result["kill"] = kill_run(remote, queries, truth["ids"], plan)
                result["search_ms"][str(count)] = quantiles(run["ms"], rng)
                result["final_equal_unsharded"][str(count)] = run["equal_share"]
                result["memory_per_shard_mib"][str(count)] = run["memory_per_shard_mib"]
                result["merge_overhead_ms"][str(count)] = {
                    "by_stage": [
                        {"p50": float(np.percentile(s, 50)), "p99": float(np.percentile(s, 99))}
                        for s in run["merge_ms_by_stage"]
                    ]
                }
    finally:
        ray.shutdown()
    result["hnsw_merged_recall_at10"] = hnsw_recall(args, queries, args.seed + 7)
    result["simulated"] = project(measured_costs(whole, queries, result), args.dim)
    result["settings"] = {key: str(value) for key, value in vars(args).items()}
    result["regime"] = (
        "retrieval only (no engine): r is reported by the projection, against an assumed prefill"
    )
    write_json("scale_shards", result)
    plot(result, plot_path("scale_shards"))
    summary = {
        "final_equal_unsharded": result["final_equal_unsharded"],
        "hnsw_merged_recall_at10": result["hnsw_merged_recall_at10"],
        "merge_overhead_ms_p50": {
            n: max(s["p50"] for s in v["by_stage"]) for n, v in result["merge_overhead_ms"].items()
        },
        "search_ms_p50": {
            "unsharded": result["unsharded"]["p50"],
            **{n: v["p50"] for n, v in result["search_ms"].items()},
        },
        "kill": result["kill"],
    }
    print_summary(summary, rerun="bench.scale.shards --quick")


if __name__ == "__main__":
    main()
