"""A corpus that changes while it serves: update throughput, search latency under updates, recall.

``python -m bench.updates --quick`` builds a staged IVF index (the service's default kind and
settings) over ``--passages`` synthetic documents (100,000 with ``--quick``), opens it as a live
corpus (:mod:`specrag.pipeline.store.live_corpus`: the durable log, fsynced per change, and the index
following) and measures, in one run:

1. update throughput, documents a second: replacements one at a time, then in batches of
   ``--batch`` (each batch one transaction and one swap);
2. search latency (the staged search as the service runs it, all stages, one query at a time)
   with no updates and while a steady ``--rate`` updates a second replace documents, in
   alternating rounds over the same queries: p50/p99 with bootstrap intervals and their ratio;
3. recall@5 against the exact top-5 of the live documents, after a fifth of the corpus was
   replaced, of the live index and of a fresh build of the same documents with the same settings;
4. compaction (the replaced rows dropped from the lists) and drift: ``--drifted`` documents
   (15 % of the corpus) from another mixture are added, and recall@5 of queries near them is
   measured with the build's centroids, after re-training them while serving, and on a fresh
   build; with the time each swap held writes back.

The documents' vectors are drawn from a Gaussian mixture (:mod:`specrag.retrieval.synthetic`) and
the replacements from the same mixture, so the old lists' centroids fit the new vectors as they
would for documents of the same kind; the documents carry their vector (a table embedder) and a
stand-in tokenizer gives each one token, so the throughput is that of the log and the index, not
of an embedding model or a tokenizer. Search latency is the retrieval's, not an answer's TTFT.

5. history: ``HISTORY_DOCUMENTS`` documents of a small corpus (``HISTORY_PASSAGES``) replaced
   ``HISTORY_REPLACEMENTS`` times in all, in batches of all of them; after the first batch and after
   the last, the log's bytes (file and WAL), and a start in a fresh process (open the store and
   replay its log, :meth:`LiveCorpus.replayed`): its time, its RSS, and the log's bytes after the
   start's checkpoint. A bounded history gives the same start after either (``--history-only``
   measures this alone).

Results: ``bench/out/updates.json`` and ``bench/out/updates.png``; the last line is the JSON
summary with ``recall_at5_fresh_build``, ``recall_at5_after_updates``,
``query_p99_ratio_updating_over_idle`` and the throughput figures. docs/updates.md quotes it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import faiss
import numpy as np
from matplotlib import pyplot as plt

from bench.common import (
    bootstrap_mean_ci,
    machine,
    percentile_ci,
    print_summary,
    save_figure,
    write_json,
    write_report,
)
from specrag.pipeline.store.document_store import build_store
from specrag.pipeline.store.live_corpus import LiveCorpus
from specrag.pipeline.store.live_log import live_log_path
from specrag.pipeline.store.live_store import LiveStore
from specrag.retrieval.corpus import Passage
from specrag.retrieval.staged_ivf import StagedIVF
from specrag.retrieval.synthetic import GaussianMixture, queries_near
from specrag.retrieval.vector_index import VectorIndex

K = 5
REPLACED_SHARE = 0.2
DRIFTED_SHARE = 0.15
HISTORY_PASSAGES = 2000
HISTORY_DOCUMENTS = 100
HISTORY_REPLACEMENTS = 10_000
# A replacement's text: about a kilobyte of words, then the ``vec:<n>`` that names its vector.
HISTORY_WORDS = "the words of a document that is replaced again and again " * 18


class TableEmbedder:
    """The vector a document carries: its text is ``vec:<n>``, row n of the table."""

    kind = "table"

    def __init__(self, table: np.ndarray) -> None:
        self.table = table

    @property
    def dim(self) -> int:
        return int(self.table.shape[1])

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        return self.table[[int(text.rsplit(":", 1)[1]) for text in texts]]

    def save(self, directory: Path) -> dict[str, Any]:
        raise NotImplementedError("a benchmark's table embedder is never saved")


def stand_in_tokens(texts: list[str]) -> list[list[int]]:
    """One token a document: the store keeps tokens, the benchmark does not measure a tokenizer."""
    return [[len(text)] for text in texts]


def search_ms(index: VectorIndex, query: np.ndarray) -> float:
    """One staged search run to its end as the service runs it (default plan), in milliseconds."""
    started = time.perf_counter()
    for _ in index.search_staged(query, K):
        pass
    return (time.perf_counter() - started) * 1000


class Replacer:
    """Replaces documents ``next`` onwards with their new vectors, one a call."""

    def __init__(self, corpus: LiveCorpus, base: int) -> None:
        self.corpus = corpus
        self.base = base  # row of replacement vector 0 in the embedder's table
        self.next = 0

    def replace(self, count: int) -> None:
        documents = [
            Passage(f"d{self.next + i}", "", f"vec:{self.base + self.next + i}") for i in range(count)
        ]
        self.corpus.put(documents)
        self.next += count


def steady_updates(replacer: Replacer, rate: float, stop: threading.Event, done: list[float]) -> None:
    """One replacement every 1/rate seconds until ``stop``; records when each was acknowledged."""
    faiss.omp_set_num_threads(1)
    interval = 1.0 / rate
    due = time.perf_counter()
    while not stop.is_set():
        replacer.replace(1)
        done.append(time.perf_counter())
        due += interval
        stop.wait(max(0.0, due - time.perf_counter()))


def latency_rounds(
    corpus: LiveCorpus, replacer: Replacer, queries: np.ndarray, rounds: int, rate: float
) -> dict[str, Any]:
    """Alternate rounds over the same queries: idle, then with ``rate`` updates a second."""
    idle: list[float] = []
    updating: list[float] = []
    updates: list[float] = []
    updating_s = 0.0
    for _ in range(rounds):
        idle += [search_ms(corpus.index, query) for query in queries]
        stop = threading.Event()
        writer = threading.Thread(target=steady_updates, args=(replacer, rate, stop, updates))
        started = time.perf_counter()
        writer.start()
        updating += [search_ms(corpus.index, query) for query in queries]
        stop.set()
        writer.join()
        updating_s += time.perf_counter() - started
    return {"idle_ms": idle, "updating_ms": updating, "updates": len(updates), "updating_s": updating_s}


def exact_top(vectors: np.ndarray, queries: np.ndarray, k: int) -> np.ndarray:
    """Row numbers of the exact top-k by inner product, one row per query."""
    scores = queries @ vectors.T
    top = np.argpartition(-scores, k, axis=1)[:, :k]
    return np.take_along_axis(top, np.argsort(-np.take_along_axis(scores, top, axis=1), axis=1), axis=1)


def recall(found: np.ndarray, exact: np.ndarray) -> float:
    return float(
        np.mean(
            [
                len(set(f.tolist()) & set(e.tolist())) / exact.shape[1]
                for f, e in zip(found, exact, strict=True)
            ]
        )
    )


def measure(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    rng = np.random.default_rng(args.seed)
    mixture = GaussianMixture(args.dim, num_clusters=args.clusters, seed=args.seed)
    replaced = int(args.passages * REPLACED_SHARE)
    drifted = int(args.passages * DRIFTED_SHARE)
    other = GaussianMixture(args.dim, num_clusters=args.clusters, seed=args.seed + 7)
    # Rows past the corpus: the replacements, then the drifted documents.
    table = np.concatenate([mixture.sample(args.passages + replaced), other.sample(drifted)])
    queries = queries_near(table[: args.passages], args.queries, seed=args.seed + 1)
    passages = [Passage(f"d{i}", "", f"vec:{i}") for i in range(args.passages)]

    started = time.perf_counter()
    searcher = StagedIVF.build(table[: args.passages], seed=args.seed)
    build_s = time.perf_counter() - started
    store_path = workdir / "store.sqlite"
    build_store(store_path, passages, stand_in_tokens, "stand-in")
    index = VectorIndex(searcher, [p.id for p in passages], embedder=TableEmbedder(table))
    # Compaction and re-training are run (and timed) below, not in the background.
    corpus = LiveCorpus.replayed(LiveStore(store_path), index, stand_in_tokens, compact_share=None)
    replacer = Replacer(corpus, args.passages)

    started = time.perf_counter()
    for _ in range(args.singles):
        replacer.replace(1)
    singles_per_s = args.singles / (time.perf_counter() - started)

    # One OpenMP thread a search, as the service's search threads run (SearchRunner): on a busy
    # machine a second one holds every stage up at its barrier.
    faiss.omp_set_num_threads(1)
    rounds = latency_rounds(corpus, replacer, queries, args.rounds, args.rate)
    faiss.omp_set_num_threads(os.cpu_count() or 1)

    started = time.perf_counter()
    batched = 0
    while replacer.next + args.batch <= replaced:
        replacer.replace(args.batch)
        batched += args.batch
    batches_per_s = batched / (time.perf_counter() - started)
    if replacer.next < replaced:
        replacer.replace(replaced - replacer.next)

    # The live documents: the base's not replaced, then every replacement (document i's new vector).
    live_vectors = np.concatenate(
        [table[replaced : args.passages], table[args.passages : args.passages + replaced]]
    )
    document_of_live = np.concatenate([np.arange(replaced, args.passages), np.arange(replaced)])
    exact = document_of_live[exact_top(live_vectors, queries, K)]
    _, live_rows = corpus.index.search(queries, K, batch=True)
    live_documents = np.vectorize(lambda row: int(corpus.index.passage_ids[row][1:]))(live_rows)
    started = time.perf_counter()
    fresh = StagedIVF.build(live_vectors, seed=args.seed)
    fresh_build_s = time.perf_counter() - started
    _, fresh_rows = fresh.search(queries, K)

    drift = measure_drift(args, corpus, table, live_vectors, document_of_live, replaced, drifted)
    idle, updating = np.array(rounds["idle_ms"]), np.array(rounds["updating_ms"])
    return {
        **drift,
        "passages": args.passages,
        "dim": args.dim,
        "index": searcher.settings,
        "replaced": replaced,
        "hidden_rows": corpus.index.hidden_rows,
        "index_build_s": build_s,
        "fresh_build_s": fresh_build_s,
        "updates_per_s_one_at_a_time": singles_per_s,
        "updates_per_s_batched": batches_per_s,
        "batch": args.batch,
        "update_rate_asked": args.rate,
        "update_rate_achieved": rounds["updates"] / rounds["updating_s"],
        "recall_at5_fresh_build": recall(document_of_live[fresh_rows], exact),
        "recall_at5_after_updates": recall(live_documents, exact),
        "idle_ms": rounds["idle_ms"],
        "updating_ms": rounds["updating_ms"],
        "query_ms": {
            name: {
                "p50": float(np.percentile(values, 50)),
                "p99": float(np.percentile(values, 99)),
                "p50_ci": percentile_ci(values, 50, rng),
                "p99_ci": percentile_ci(values, 99, rng),
                "mean_ci": bootstrap_mean_ci(values, rng),
            }
            for name, values in (("idle", idle), ("updating", updating))
        },
    }


def history_index(dim: int, seed: int, passages: int, replacements: int) -> VectorIndex:
    """The history measurement's index over ``passages`` documents, its embedder's table holding a
    vector for each replacement too (seeded: a start in another process draws the same)."""
    table = GaussianMixture(dim, num_clusters=64, seed=seed + 11).sample(passages + replacements)
    searcher = StagedIVF.build(table[:passages], nlist=64, seed=seed)
    return VectorIndex(searcher, [f"d{i}" for i in range(passages)], embedder=TableEmbedder(table))


def log_bytes(store_path: Path) -> int:
    """The live log's bytes on disk: its file and its WAL."""
    log = live_log_path(store_path)
    return sum(path.stat().st_size for path in (log, log.with_name(log.name + "-wal")) if path.exists())


def rss_mb() -> float:
    """This process's resident memory, in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def start_up(store_path: str, dim: int, seed: int, passages: int, replacements: int) -> None:
    """A start in this (fresh) process: the index built first, then the store opened and its log
    replayed, timed; prints the figures as JSON (run by :func:`measure_history` in a subprocess)."""
    index = history_index(dim, seed, passages, replacements)
    before = rss_mb()
    started = time.perf_counter()
    corpus = LiveCorpus.replayed(LiveStore(Path(store_path)), index, stand_in_tokens, compact_share=None)
    replay_s = time.perf_counter() - started
    after = rss_mb()
    corpus.store.close()
    print(json.dumps({"start_up_s": replay_s, "rss_mb": after, "rss_replay_mb": after - before}))


def measured_start(shape: tuple[int, int, int, int], store_path: Path, serving_bytes: int) -> dict[str, Any]:
    """The log's bytes while it was written (``serving_bytes``) and after a start, and the start's
    figures (in a fresh process)."""
    code = f"from bench.updates.__main__ import start_up; start_up({str(store_path)!r}, *{shape!r})"
    child = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=600
    )
    return {
        "log_bytes": serving_bytes,
        **json.loads(child.stdout.splitlines()[-1]),
        "log_bytes_after_start": log_bytes(store_path),
    }


def measure_history(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Log bytes, RSS and start-up after the first batch of replacements and after all of them."""
    store_path = workdir / "history" / "store.sqlite"
    # What a start in another process needs to draw the same index: dim, seed, passages, replacements.
    shape = (args.dim, args.seed, HISTORY_PASSAGES, HISTORY_REPLACEMENTS)
    passages = [Passage(f"d{i}", "", f"vec:{i}") for i in range(HISTORY_PASSAGES)]
    build_store(store_path, passages, stand_in_tokens, "stand-in")
    written = 0
    result: dict[str, Any] = {
        "passages": HISTORY_PASSAGES,
        "documents": HISTORY_DOCUMENTS,
        "replacements": HISTORY_REPLACEMENTS,
    }
    for name, until in (("after_first", HISTORY_DOCUMENTS), ("after_all", HISTORY_REPLACEMENTS)):
        corpus = LiveCorpus.replayed(
            LiveStore(store_path), history_index(*shape), stand_in_tokens, compact_share=None
        )
        while written < until:
            corpus.put(
                [
                    Passage(f"d{i}", "", f"{HISTORY_WORDS}vec:{HISTORY_PASSAGES + written + i}")
                    for i in range(HISTORY_DOCUMENTS)
                ]
            )
            written += HISTORY_DOCUMENTS
        serving_bytes = log_bytes(store_path)  # before the close checkpoints the WAL
        corpus.store.close()
        result[name] = measured_start(shape, store_path, serving_bytes)
    return result


def measure_drift(
    args: argparse.Namespace,
    corpus: LiveCorpus,
    table: np.ndarray,
    live_vectors: np.ndarray,
    document_of_live: np.ndarray,
    replaced: int,
    drifted: int,
) -> dict[str, Any]:
    """Compact, add documents of another mixture, and compare recall on them before and after
    re-training the centroids while serving, and on a fresh build."""
    same_distribution_drift = corpus.drift  # of the replacements: the build's own mixture
    started = time.perf_counter()
    dropped = corpus.compact()
    compaction_s = time.perf_counter() - started
    first = args.passages + replaced
    vectors = table[first : first + drifted]
    for start in range(0, drifted, args.batch):
        count = min(args.batch, drifted - start)
        corpus.put([Passage(f"x{start + i}", "", f"vec:{first + start + i}") for i in range(count)])
    drift = corpus.drift
    queries = queries_near(vectors, args.queries, seed=args.seed + 2)
    every_vector = np.concatenate([live_vectors, vectors])
    every_document = np.concatenate([document_of_live, np.arange(args.passages, args.passages + drifted)])
    exact = every_document[exact_top(every_vector, queries, K)]

    def live_recall() -> float:
        _, rows = corpus.index.search(queries, K, batch=True)
        ids = [[corpus.index.passage_ids[row] for row in found] for found in rows]
        number = [[int(i[1:]) + (args.passages if i[0] == "x" else 0) for i in found] for found in ids]
        return recall(np.array(number), exact)

    before = live_recall()
    started = time.perf_counter()
    corpus.compact(retrain=True)
    retraining_s = time.perf_counter() - started
    after = live_recall()
    fresh = StagedIVF.build(every_vector, seed=args.seed)
    _, fresh_rows = fresh.search(queries, K)
    return {
        "drift_same_distribution": same_distribution_drift,
        "compaction_rows_dropped": dropped,
        "compaction_s": compaction_s,
        "drifted_documents": drifted,
        "drift": drift,
        "recall_at5_drifted_build_centroids": before,
        "recall_at5_drifted_retrained": after,
        "recall_at5_drifted_fresh_build": recall(every_document[fresh_rows], exact),
        "retraining_s": retraining_s,
    }


def plot(result: dict[str, Any], path: Path) -> None:
    figure, (latency, recalls) = plt.subplots(1, 2, figsize=(11, 4))
    for name in ("idle", "updating"):
        values = np.sort(result[f"{name}_ms"])
        latency.plot(
            values,
            np.linspace(0, 1, len(values)),
            label=f"{name} (p99 {result['query_ms'][name]['p99']:.1f} ms)",
        )
    latency.set_xlabel("staged search, ms")
    latency.set_ylabel("share of queries")
    latency.set_title(f"search latency, idle vs {result['update_rate_achieved']:.0f} updates/s")
    latency.legend()
    names = [
        "fresh\nbuild",
        "live, 20 %\nreplaced",
        "drifted,\nold centroids",
        "drifted,\nretrained",
        "drifted,\nfresh build",
    ]
    recall_values = [
        result["recall_at5_fresh_build"],
        result["recall_at5_after_updates"],
        result["recall_at5_drifted_build_centroids"],
        result["recall_at5_drifted_retrained"],
        result["recall_at5_drifted_fresh_build"],
    ]
    recalls.bar(names, recall_values, color=["grey", "tab:blue", "tab:red", "tab:green", "grey"])
    recalls.set_ylim(min(recall_values) - 0.05, 1.0)
    recalls.set_title(f"recall@5, {result['passages']:,} passages")
    save_figure(figure, path)


def history_summary(history: dict[str, Any]) -> dict[str, Any]:
    """The history figures of the summary line: after the first batch, then after all of them."""
    return {
        f"history_{figure}_{when}": round(history[when][figure], 3)
        for when in ("after_first", "after_all")
        for figure in ("log_bytes", "log_bytes_after_start", "start_up_s", "rss_mb")
    }


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.updates", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="100,000 passages, 200 queries, 2 rounds")
    parser.add_argument(
        "--passages", type=int, help="documents in the corpus (default: 100,000 quick, 300,000)"
    )
    parser.add_argument("--dim", type=int, default=128, help="vector dimensions")
    parser.add_argument("--clusters", type=int, default=1024, help="Gaussian mixture clusters")
    parser.add_argument("--queries", type=int, help="queries a round (default: 200 quick, 500)")
    parser.add_argument("--rounds", type=int, help="idle and updating rounds each (default: 2 quick, 4)")
    parser.add_argument("--rate", type=float, default=50.0, help="updates a second during updating rounds")
    parser.add_argument("--singles", type=int, default=500, help="replacements timed one at a time")
    parser.add_argument("--batch", type=int, default=500, help="documents a batch for the batched figure")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--history-only", action="store_true", help="measure only the history: log bytes, RSS, start-up"
    )
    args = parser.parse_args()
    args.passages = args.passages or (100_000 if args.quick else 300_000)
    args.queries = args.queries or (200 if args.quick else 500)
    args.rounds = args.rounds or (2 if args.quick else 4)
    if args.passages < 1000 or args.dim < 2 or args.rate <= 0 or args.batch < 1 or args.singles < 1:
        parser.error("--passages >= 1000, --dim >= 2, --rate > 0, --batch and --singles >= 1")
    with tempfile.TemporaryDirectory(prefix="specrag-updates-") as workdir:
        history = measure_history(args, Path(workdir))
        if args.history_only:
            path = write_json("updates-history", {"history": history, "machine": machine()})
            print_summary({**history_summary(history), "report": [str(path)]}, "bench.updates --history-only")
            return
        result = measure(args, Path(workdir))
    result["history"] = history
    result["machine"] = machine()
    json_path, png_path = write_report("updates", result, lambda path: plot(result, path))
    idle, updating = result["query_ms"]["idle"], result["query_ms"]["updating"]
    summary = {
        "passages": result["passages"],
        "recall_at5_fresh_build": round(result["recall_at5_fresh_build"], 4),
        "recall_at5_after_updates": round(result["recall_at5_after_updates"], 4),
        "query_p50_ms_idle": round(idle["p50"], 2),
        "query_p99_ms_idle": round(idle["p99"], 2),
        "query_p50_ms_updating": round(updating["p50"], 2),
        "query_p99_ms_updating": round(updating["p99"], 2),
        "query_p99_ratio_updating_over_idle": round(updating["p99"] / idle["p99"], 3),
        "update_rate_achieved": round(result["update_rate_achieved"], 1),
        "updates_per_s_one_at_a_time": round(result["updates_per_s_one_at_a_time"], 1),
        "updates_per_s_batched": round(result["updates_per_s_batched"], 1),
        "compaction_s": round(result["compaction_s"], 3),
        "drift_same_distribution": round(result["drift_same_distribution"], 3),
        "drift": round(result["drift"], 3),
        "recall_at5_drifted_build_centroids": round(result["recall_at5_drifted_build_centroids"], 4),
        "recall_at5_drifted_retrained": round(result["recall_at5_drifted_retrained"], 4),
        "recall_at5_drifted_fresh_build": round(result["recall_at5_drifted_fresh_build"], 4),
        "retraining_s": round(result["retraining_s"], 2),
        **history_summary(history),
        "report": [str(json_path), str(png_path)],
    }
    print_summary(summary, "bench.updates --quick   (full: drop --quick)")


if __name__ == "__main__":
    main()
