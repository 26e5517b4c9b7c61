"""Staged vector search: recall, staging overhead and how early the final top-k appears.

For IVF (faiss) and HNSW (faiss graph, resumable numba search) at a few sizes of synthetic
384-d data and S ∈ {1, 2, 4, 8} stages, one query at a time on one pinned core with one thread:

* recall@k of the one-shot search against exact search;
* overhead: the sum over queries of a staged search's time / that of the one-shot search;
* whether the last stage equals the one-shot search, on every query;
* stability: after each stage, the fraction of queries whose running top-k already equals the
  final top-k as a set and as a list (what a speculative prefill would have got right);
* stage schedules: equal slices at S = 4, geometric ones (1/8, 1/4, 1/2, 1 of the work) at
  S = 4, (1/16 first) at S = 5 (``geometric/5``) and (1/32 first) at S = 6 (``geometric/6``),
  and a time budget of a quarter of the one-shot search per stage: for each, how often the first
  stage's top-k is already final, when (as a share of the search's time) the running top-k first
  equals the final one, and the cost against the one-shot search and against the same index's
  single-stage staged search (the schedule's own cost: the HNSW kernel alone is slower than
  faiss's search, whatever the schedule). The best schedule of each index kind is the one whose
  top-k is final earliest on average while its own cost stays within ``MAX_SCHEDULE_OVERHEAD``;
* for comparison, a second HNSW implementation on the same vectors and queries: hnswlib, built
  with the same M, efConstruction and efSearch, searched one-shot (recall@k against the same
  exact search, latency on the same core). Only up to ``HNSWLIB_MAX_SIZE`` vectors: its build
  costs about what faiss's does, many minutes at 1M on two cores.

Rerun: ``.venv/bin/python -m bench.retrieval.search --quick`` (about two minutes) or without ``--quick``
(1M vectors; builds take several minutes). Writes bench/out/search.json and search.png; the
last line printed is a JSON summary.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

import faiss
import hnswlib
import matplotlib.pyplot as plt
import numpy as np

from bench.common import machine, plot_path, print_summary, save_figure, write_json
from specrag.retrieval.backends.local.staged_hnsw import StagedHNSW
from specrag.retrieval.backends.local.staged_ivf import StagedIVF
from specrag.retrieval.search.search_runner import pin_current_thread
from specrag.retrieval.search.stages import StagedSearcher, StagePlan
from specrag.retrieval.synthetic import GaussianMixture, queries_near

STAGE_COUNTS = (1, 2, 4, 8)
SCHEDULE_STAGES = 4
SCHEDULE_NAMES = ("equal", "geometric", "geometric/5", "geometric/6", "budget")
MAX_SCHEDULE_OVERHEAD = 1.10
DIM = 384
# StagedHNSW.build's default, given to hnswlib too so both graphs are built alike.
EF_CONSTRUCTION = 40
HNSWLIB_MAX_SIZE = 100_000
T = TypeVar("T")
P = ParamSpec("P")


@dataclass(frozen=True)
class Setting:
    kind: str
    size: int
    params: dict[str, int]


QUICK = [
    Setting("ivf", 100_000, {"nlist": 256, "nprobe": 128}),
    Setting("ivf", 400_000, {"nlist": 256, "nprobe": 128}),
    Setting("hnsw", 50_000, {"m": 16, "ef_search": 256}),
]
FULL = [
    Setting("ivf", 250_000, {"nlist": 1024, "nprobe": 256}),
    Setting("ivf", 1_000_000, {"nlist": 1024, "nprobe": 256}),
    Setting("hnsw", 100_000, {"m": 16, "ef_search": 512}),
    Setting("hnsw", 1_000_000, {"m": 16, "ef_search": 512}),
]


def build(setting: Setting, vectors: np.ndarray) -> StagedSearcher:
    if setting.kind == "ivf":
        return StagedIVF.build(vectors, nlist=setting.params["nlist"], nprobe=setting.params["nprobe"])
    return StagedHNSW.build(
        vectors, m=setting.params["m"], ef_construction=EF_CONSTRUCTION, ef_search=setting.params["ef_search"]
    )


def build_hnswlib(setting: Setting, vectors: np.ndarray, threads: int, seed: int) -> Any:
    """hnswlib's graph over the same rows (row i = label i) with faiss's M and efConstruction."""
    index: Any = hnswlib.Index(space="ip", dim=vectors.shape[1])
    index.init_index(
        max_elements=len(vectors), M=setting.params["m"], ef_construction=EF_CONSTRUCTION, random_seed=seed
    )
    index.add_items(vectors, np.arange(len(vectors)), num_threads=threads)
    index.set_ef(setting.params["ef_search"])
    return index


def measure_hnswlib(index: Any, queries: np.ndarray, exact_ids: np.ndarray, k: int) -> dict[str, float]:
    """One-shot hnswlib searches, one query at a time on one thread: latency and recall@k."""
    for warm in queries[:5]:
        index.knn_query(warm, k=k, num_threads=1)
    times = np.zeros(len(queries))
    found = np.zeros((len(queries), k), dtype=np.int64)
    for q, query in enumerate(queries):
        start = time.perf_counter()
        labels, _ = index.knn_query(query, k=k, num_threads=1)
        times[q] = time.perf_counter() - start
        found[q] = labels[0]
    return {
        "oneshot_ms_mean": float(times.mean() * 1e3),
        "oneshot_ms_median": float(np.median(times) * 1e3),
        "recall_at_k": recall(found, exact_ids),
    }


def timed(make: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> tuple[T, float]:
    """What ``make(*args, **kwargs)`` returns and the seconds it took."""
    start = time.perf_counter()
    made = make(*args, **kwargs)
    return made, time.perf_counter() - start


def plans(oneshot_s: float) -> dict[str, StagePlan]:
    """Every staged variant by name: equal slices at each of ``STAGE_COUNTS``, and the schedules.

    The time budget is a quarter of the warm one-shot search per stage, so that it too cuts a
    search into about ``SCHEDULE_STAGES`` stages.
    """
    variants = {str(s): StagePlan(s, "equal") for s in STAGE_COUNTS}
    variants["geometric"] = StagePlan(SCHEDULE_STAGES, schedule="geometric")
    variants["geometric/5"] = StagePlan(SCHEDULE_STAGES + 1, schedule="geometric")
    variants["geometric/6"] = StagePlan(SCHEDULE_STAGES + 2, schedule="geometric")
    variants["budget"] = StagePlan.budget(oneshot_s / SCHEDULE_STAGES)
    return variants


def schedule_variant(name: str) -> str:
    """The variant that runs schedule ``name`` (equal slices at S = 4 are the variant "4")."""
    return str(SCHEDULE_STAGES) if name == "equal" else name


def measure(searcher: StagedSearcher, queries: np.ndarray, k: int) -> dict[str, Any]:
    """Time one-shot and staged searches query by query, rotating their order against drift."""
    warm_times = []
    for warm in queries[:5]:  # page in, JIT and cache warm-up, not timed
        list(searcher.stages(warm, k, StagePlan(4, "equal")))
        start = time.perf_counter()
        searcher.search(warm, k)
        warm_times.append(time.perf_counter() - start)
    staged = plans(float(np.median(warm_times)))
    variants = ["oneshot", *staged]
    times = {v: np.zeros(len(queries)) for v in variants}
    final_equal = {v: True for v in staged}
    oneshot_ids = np.zeros((len(queries), k), dtype=np.int64)
    running: dict[str, list[list[np.ndarray]]] = {v: [] for v in staged}
    elapsed_fraction: dict[str, list[list[float]]] = {v: [] for v in staged}
    for q, query in enumerate(queries):
        order = variants[q % len(variants) :] + variants[: q % len(variants)]
        for variant in order:
            start = time.perf_counter()
            if variant == "oneshot":
                oneshot_ids[q] = searcher.search(query, k)[1][0]
                times[variant][q] = time.perf_counter() - start
                continue
            stages = list(searcher.stages(query, k, staged[variant]))
            times[variant][q] = time.perf_counter() - start
            running[variant].append([stage.ids[0] for stage in stages])
            cumulative = np.cumsum([stage.elapsed_s for stage in stages])
            elapsed_fraction[variant].append(list(cumulative / cumulative[-1]))
        for v in staged:
            final_equal[v] &= bool(np.array_equal(running[v][q][-1], oneshot_ids[q]))

    def figures(variant: str, stages: int) -> dict[str, Any]:
        return {
            "overhead": float(times[variant].sum() / times["oneshot"].sum()),
            "staging_overhead": float(times[variant].sum() / times["1"].sum()),
            "final_equals_oneshot": final_equal[variant],
            **stability(running[variant], elapsed_fraction[variant], stages),
        }

    result: dict[str, Any] = {
        "oneshot_ms_mean": float(times["oneshot"].mean() * 1e3),
        "oneshot_ms_median": float(np.median(times["oneshot"]) * 1e3),
        "final_equals_oneshot": all(final_equal.values()),
        "per_stage_count": {str(s): figures(str(s), s) for s in STAGE_COUNTS},
    }
    result["per_schedule"] = {}
    for name in SCHEDULE_NAMES:
        variant = schedule_variant(name)
        most_stages = max(len(stages) for stages in running[variant])
        result["per_schedule"][name] = figures(variant, most_stages)
    result["oneshot_ids"] = oneshot_ids
    return result


def best_schedule(results: list[dict[str, Any]]) -> dict[str, str]:
    """Per index kind, the schedule whose top-k is final earliest (mean over that kind's
    settings) within the cost limit (its time over a single-stage staged search on the same
    index).

    Per kind, because how early a search holds its final top-k is a property of the index kind
    (an IVF scan visits the nearest lists first, a graph search has to walk to the
    neighbourhood), and the service's stage count follows the kind (``DEFAULT_STAGES``). Equal
    slices are the fallback when no other schedule qualifies.
    """
    best = {}
    for kind in dict.fromkeys(r["kind"] for r in results):
        of_kind = [r for r in results if r["kind"] == kind]
        qualified = {
            name: float(np.mean([r["per_schedule"][name]["final_at_time_fraction"] for r in of_kind]))
            for name in SCHEDULE_NAMES
            if all(r["per_schedule"][name]["staging_overhead"] <= MAX_SCHEDULE_OVERHEAD for r in of_kind)
        }
        best[kind] = min(qualified, key=lambda name: qualified[name]) if qualified else "equal"
    return best


def stability(per_query: list[list[np.ndarray]], fractions: list[list[float]], stages: int) -> dict[str, Any]:
    """Per stage: share of queries whose running top-k equals the final one (set, list), overlap;
    and the mean share of a search's time after which its running top-k set is first final.

    A search that finished in fewer stages (HNSW, or IVF with fewer probes than stages) counts
    as final for the remaining ones.
    """
    as_set, as_list, overlap, time_share = [], [], [], []
    for s in range(stages):
        sets = lists = 0
        share = 0.0
        spent = 0.0
        for query_stages, query_fractions in zip(per_query, fractions, strict=True):
            current, final = query_stages[min(s, len(query_stages) - 1)], query_stages[-1]
            sets += set(current.tolist()) == set(final.tolist())
            lists += bool(np.array_equal(current, final))
            share += len(set(current.tolist()) & set(final.tolist())) / len(final)
            spent += query_fractions[min(s, len(query_fractions) - 1)]
        count = len(per_query)
        as_set.append(sets / count)
        as_list.append(lists / count)
        overlap.append(share / count)
        time_share.append(spent / count)
    final_at = [
        next(
            fraction
            for ids, fraction in zip(query_stages, query_fractions, strict=True)
            if set(ids.tolist()) == set(query_stages[-1].tolist())
        )
        for query_stages, query_fractions in zip(per_query, fractions, strict=True)
    ]
    return {
        "final_at_time_fraction": float(np.mean(final_at)),
        "stable_set_after_stage": as_set,
        "stable_list_after_stage": as_list,
        "overlap_after_stage": overlap,
        "time_fraction_after_stage": time_share,
    }


def recall(found: np.ndarray, exact: np.ndarray) -> float:
    hits = sum(len(set(f.tolist()) & set(e.tolist())) for f, e in zip(found, exact, strict=True))
    return hits / exact.size


def plot(results: list[dict[str, Any]]) -> str:
    figure, (left, right, schedules) = plt.subplots(1, 3, figsize=(16, 4))
    for entry in results:
        label = f"{entry['kind']} {entry['size']:,}"
        curve = entry["per_stage_count"]["4"]["stable_set_after_stage"]
        left.plot(range(1, len(curve) + 1), curve, marker="o", label=label)
        overheads = [entry["per_stage_count"][str(s)]["overhead"] for s in STAGE_COUNTS]
        right.plot(STAGE_COUNTS, overheads, marker="o", label=label)
        for name, row in entry["per_schedule"].items():
            schedules.plot(
                [0.0, *row["time_fraction_after_stage"]],
                [0.0, *row["stable_set_after_stage"]],
                marker="o",
                label=f"{label} {name}",
            )
    schedules.set(xlabel="share of the search's time", ylabel="queries with final top-k set", ylim=(0, 1.02))
    left.set(xlabel="stage (S = 4)", ylabel="queries with final top-k set", ylim=(0, 1.02))
    right.set(xlabel="stages S", ylabel="staged time / one-shot time", xscale="log", xticks=STAGE_COUNTS)
    right.set_xticklabels([str(s) for s in STAGE_COUNTS])
    right.axhline(1.0, color="grey", linewidth=0.5)
    for axis in (left, right, schedules):
        axis.grid(alpha=0.3)
        axis.legend()
    figure.suptitle("Staged vector search (one core, one thread)")
    path = save_figure(figure, plot_path("search"))
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--quick", action="store_true", help="smaller sizes; about two minutes")
    parser.add_argument("--queries", type=int, default=None, help="queries per setting (default 100 / 200)")
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    started = time.perf_counter()
    settings = QUICK if args.quick else FULL
    num_queries = args.queries or (100 if args.quick else 200)
    allowed = sorted(os.sched_getaffinity(0))
    search_core = allowed[-1]

    print(f"generating {max(s.size for s in settings):,} × {DIM} Gaussian-mixture vectors (seed {args.seed})")
    data = GaussianMixture(DIM, seed=args.seed).sample(max(s.size for s in settings))
    results: list[dict[str, Any]] = []
    for setting in settings:
        vectors = data[: setting.size]
        queries = queries_near(vectors, num_queries, seed=args.seed + 1)
        pin_current_thread(allowed)
        faiss.omp_set_num_threads(len(allowed))
        searcher, build_s = timed(build, setting, vectors)
        second_hnsw = (
            timed(build_hnswlib, setting, vectors, len(allowed), args.seed)
            if setting.kind == "hnsw" and setting.size <= HNSWLIB_MAX_SIZE
            else None
        )
        exact = faiss.IndexFlatIP(DIM)
        exact.add(vectors)
        exact_ids = exact.search(queries, args.k)[1]
        del exact
        # Searches run pinned to one core with one thread, as a search server apart from the engine.
        pin_current_thread([search_core])
        faiss.omp_set_num_threads(1)
        entry = measure(searcher, queries, args.k)
        entry.update(
            kind=setting.kind,
            size=setting.size,
            params=setting.params,
            build_s=build_s,
            recall_at_k=recall(entry.pop("oneshot_ids"), exact_ids),
        )
        results.append(entry)
        print(
            f"{setting.kind:4} {setting.size:>9,} {setting.params}"
            f"  one-shot {entry['oneshot_ms_median']:.2f} ms"
            f"  recall@{args.k} {entry['recall_at_k']:.3f}  final==one-shot {entry['final_equals_oneshot']}"
            f"  (built in {build_s:.0f}s)"
        )
        if second_hnsw is not None:
            index, second_build_s = second_hnsw
            entry["hnswlib"] = {
                **measure_hnswlib(index, queries, exact_ids, args.k),
                "build_s": second_build_s,
            }
            print(
                f"      hnswlib, same graph settings: one-shot {entry['hnswlib']['oneshot_ms_median']:.2f} ms"
                f"  recall@{args.k} {entry['hnswlib']['recall_at_k']:.3f}  (built in {second_build_s:.0f}s)"
            )
            del index, second_hnsw
        for s in STAGE_COUNTS:
            row = entry["per_stage_count"][str(s)]
            curve = " ".join(f"{x:.2f}" for x in row["stable_set_after_stage"])
            print(
                f"      S={s}: overhead {row['overhead']:.3f}x"
                f"  top-{args.k} set final after each stage: {curve}"
            )
        for name, row in entry["per_schedule"].items():
            print(
                f"      {name:>9}: overhead {row['overhead']:.3f}x ({row['staging_overhead']:.3f}x S=1)"
                f"  first stage final"
                f" {row['stable_set_after_stage'][0]:.2f} after {row['time_fraction_after_stage'][0]:.2f}"
                f" of the search; top-{args.k} final after {row['final_at_time_fraction']:.2f} on average"
            )
        del searcher
    pin_current_thread(allowed)

    def headline(kind: str) -> dict[str, Any]:
        return max((r for r in results if r["kind"] == kind), key=lambda r: r["size"])

    def figures(kind: str) -> dict[str, Any]:
        largest = headline(kind)
        return {
            f"{kind}_size": largest["size"],
            f"{kind}_oneshot_ms": round(largest["oneshot_ms_median"], 3),
            f"{kind}_overhead_s4": round(largest["per_stage_count"]["4"]["overhead"], 4),
            f"{kind}_final_equals_oneshot": all(
                r["final_equals_oneshot"] for r in results if r["kind"] == kind
            ),
            f"{kind}_recall_at_10": round(largest["recall_at_k"], 4),
        }

    summary = {
        "mode": "quick" if args.quick else "full",
        **figures("ivf"),
        "ivf_stable_set_after_stage": [
            round(x, 4) for x in headline("ivf")["per_stage_count"]["4"]["stable_set_after_stage"]
        ],
        **figures("hnsw"),
        "hnswlib": [
            {
                "size": r["size"],
                "oneshot_ms": round(r["hnswlib"]["oneshot_ms_median"], 3),
                "recall_at_10": round(r["hnswlib"]["recall_at_k"], 4),
                "faiss_oneshot_ms": round(r["oneshot_ms_median"], 3),
                "faiss_recall_at_10": round(r["recall_at_k"], 4),
            }
            for r in results
            if "hnswlib" in r
        ],
        "schedules": {
            name: {
                kind: {
                    "overhead": round(headline(kind)["per_schedule"][name]["overhead"], 4),
                    "staging_overhead": round(headline(kind)["per_schedule"][name]["staging_overhead"], 4),
                    "first_stage_final": round(
                        headline(kind)["per_schedule"][name]["stable_set_after_stage"][0], 4
                    ),
                    "first_stage_time_fraction": round(
                        headline(kind)["per_schedule"][name]["time_fraction_after_stage"][0], 4
                    ),
                    "final_at_time_fraction": round(
                        headline(kind)["per_schedule"][name]["final_at_time_fraction"], 4
                    ),
                }
                for kind in ("ivf", "hnsw")
            }
            for name in SCHEDULE_NAMES
        },
        "best_schedule": best_schedule(results),
        "search_core": search_core,
        "threads": 1,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    json_path = write_json(
        "search", {"summary": summary, "results": results, "machine": machine(), "k": args.k}
    )
    png_path = plot(results)
    print(f"search pinned to core {search_core}, 1 faiss thread; wrote {json_path} and {png_path}")
    print_summary(summary, "bench.retrieval.search --quick   (full: drop --quick)")


if __name__ == "__main__":
    main()
