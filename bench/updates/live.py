"""bench.updates' live-corpus measurement: update throughput, search latency under updates,
recall after replacements, compaction, drift and re-training."""

from __future__ import annotations

import argparse
import os
import threading
import time
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from bench.common import bootstrap_mean_ci, percentile_ci
from bench.updates.table import TableEmbedder, stand_in_tokens
from specrag.pipeline.store.document_store import build_store
from specrag.pipeline.store.live_corpus import LiveCorpus
from specrag.pipeline.store.live_store import LiveStore
from specrag.retrieval.backends.local.staged_ivf import StagedIVF
from specrag.retrieval.corpus import Passage
from specrag.retrieval.synthetic import GaussianMixture, queries_near
from specrag.retrieval.vector_index import VectorIndex

K = 5
REPLACED_SHARE = 0.2
DRIFTED_SHARE = 0.15


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
