"""Retrieval quality and cost of the default index and of each embedder, on a corpus with known answers.

``python -m bench.retrieval --corpus CORPUS.jsonl --queries QUERIES.jsonl [--data-dir DIR] [--quick]``
builds the default index (``IndexConfig()``: MiniLM + BM25, staged IVF) over the corpus
(``{"id", "title", "text"}`` a line), runs every query (``{"query", "answer_id"}`` a line) through
embedding and the staged search as the service does (its default stages, the query's text
given, so hybrid), and scores recall@1/5/10 with 95 % bootstrap intervals (resampling queries): a
query counts as found at k when one of the first k passages belongs to the document ``answer_id``
(its id is ``answer_id`` or starts with ``answer_id#``). The dense channel alone is scored on the
same index. The fast embedder, WordLlama, is built and scored the same way in the same run, and
``paired`` gives each embedder's recall minus the default's on the same queries, with a paired
interval. Each row says its build (``index_build_s``, ``docs_per_s``: passages over the whole
build, embedding most of it for MiniLM; ``index_build_cpu_s``, which a shared machine inflates
less) and its queries' cost (``query_ms_p50``/``p99``: embedding and search; ``embed_ms_p50``/
``p99``: the embedding alone). The last line printed is one JSON object: ``{"recall_at_1",
"recall_at_5", "recall_at_10", "dense_only": {...}, "index_build_s", "docs_per_s",
"query_ms_p50"}``. ``--quick`` keeps the first 100 queries and 500 passages besides their answers'.

``--compare`` adds the table of docs/retrieval.md: MiniLM in float32 (where the default computes in
bfloat16), the previous defaults (TF-IDF + SVD), WordLlama with the package's uniform pooling and,
with ``--sentence-transformers DIR``, a sentence-transformers model directory, each dense and
hybrid (one index per embedder, searched both ways), BM25 alone, and the default index's recall
under other fusion settings (``rrf_k`` × depth). Results go to ``bench/out/retrieval.json`` and
``bench/out/retrieval.png``. Evaluation sets: ``bench.retrieval.sets``; e.g. ``python -m
bench.retrieval.sets pydoc --out /tmp/pydoc`` then ``python -m bench.retrieval --corpus
/tmp/pydoc/corpus.jsonl --queries /tmp/pydoc/queries.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import pyplot as plt

from bench.common import bootstrap_mean_ci, machine, plot_path, print_summary, save_figure, write_json
from bench.indexes import distinct_passages, one_search_thread
from bench.traces import read_trace_lines
from specrag.errors import InvalidInputError
from specrag.retrieval.corpus import Passage, load_passages
from specrag.retrieval.embedders.embedder import Embedder, SentenceTransformerEmbedder
from specrag.retrieval.embedders.minilm_embedder import (
    FLOAT32,
    MiniLMEmbedder,
    minilm_weights,
    native_precision,
)
from specrag.retrieval.embedders.wordllama_embedder import WordLlamaEmbedder, token_vectors
from specrag.retrieval.index_store import MINILM, TFIDF_SVD, WORDLLAMA, IndexConfig, build_index, save_index
from specrag.retrieval.lexical.fusion import FusionConfig
from specrag.retrieval.vector_index import VectorIndex

KS = (1, 5, 10)
# --quick: this many queries, and this many passages besides their answers'.
QUICK_QUERIES = 100
QUICK_PASSAGES = 500


@dataclass(frozen=True)
class Query:
    text: str
    answer_id: str


@dataclass(frozen=True)
class Method:
    """One embedder of the comparison: fitted on the corpus (by kind) or built by ``make``."""

    name: str
    fitted: str = MINILM
    make: Callable[[], Embedder] | None = None

    def brought(self) -> Embedder | None:
        return self.make() if self.make else None


def load_queries(path: Path) -> list[Query]:
    try:
        lines = read_trace_lines(path)
    except InvalidInputError as error:
        raise SystemExit(str(error)) from None
    queries = []
    for number, record in lines:
        if not all(isinstance(record.get(f), str) for f in ("query", "answer_id")):
            raise SystemExit(f'{path}:{number}: expected {{"query": str, "answer_id": str}}')
        queries.append(Query(record["query"], record["answer_id"]))
    if not queries:
        raise SystemExit(f"{path}: no queries")
    return queries


def belongs(passage_id: str, answer_id: str) -> bool:
    return passage_id == answer_id or passage_id.startswith(answer_id + "#")


def quick_subset(passages: list[Passage], queries: list[Query]) -> tuple[list[Passage], list[Query]]:
    """The first queries, and the first passages plus every passage of those queries' answers."""
    kept = queries[:QUICK_QUERIES]
    answers = [passage for passage in passages if any(belongs(passage.id, q.answer_id) for q in kept)]
    chosen = {passage.id for passage in answers} | {passage.id for passage in passages[:QUICK_PASSAGES]}
    return [passage for passage in passages if passage.id in chosen], kept


def evaluate(index: VectorIndex, queries: list[Query], hybrid: bool) -> tuple[dict[str, Any], Hits]:
    """Recall@k and per-query latency (embed + every stage of the search) for one index."""
    with one_search_thread():
        return _evaluate(index, queries, hybrid)


def _evaluate(index: VectorIndex, queries: list[Query], hybrid: bool) -> tuple[dict[str, Any], Hits]:
    rankings, latencies, embedding = [], [], []
    plan = index.stage_plan()
    for query in queries:
        started = time.perf_counter()
        vector = index.embed_query(query.text)
        embedding.append(time.perf_counter() - started)
        *_, last = index.search_staged(vector, max(KS), plan, query_text=query.text if hybrid else None)
        latencies.append(time.perf_counter() - started)
        rankings.append(distinct_passages(index, last.ids))
    result = scores(queries, rankings, latencies)
    result.update(latency_ms("embed_ms", embedding))
    return result, hits_at(queries, rankings)


def lexical_only(index: VectorIndex, queries: list[Query]) -> dict[str, Any]:
    """BM25 alone, from the hybrid index's lexical channel (identifiers weighed as the hybrid does)."""
    assert index.lexical is not None
    rankings, latencies = [], []
    for query in queries:
        started = time.perf_counter()
        rows, _ = index.lexical.search(query.text, max(KS), index.fusion.identifier_weight)
        latencies.append(time.perf_counter() - started)
        rankings.append([index.passage_ids[row] for row in rows])
    return scores(queries, rankings, latencies)


Hits = dict[int, np.ndarray]
"""At each k, one 0/1 value a query: whether its answer is among the first k passages."""


def hits_at(queries: list[Query], rankings: list[list[str]]) -> Hits:
    return {
        k: np.array(
            [
                any(belongs(p, query.answer_id) for p in ranking[:k])
                for query, ranking in zip(queries, rankings, strict=True)
            ],
            dtype=np.float64,
        )
        for k in KS
    }


def latency_ms(name: str, latencies: list[float]) -> dict[str, float]:
    """``{name}_p50`` and ``{name}_p99`` of ``latencies`` (seconds) in ms."""
    p50, p99 = np.percentile(np.asarray(latencies) * 1000, [50, 99])
    return {f"{name}_p50": round(float(p50), 3), f"{name}_p99": round(float(p99), 3)}


def scores(queries: list[Query], rankings: list[list[str]], latencies: list[float]) -> dict[str, Any]:
    """Recall@k over the queries' rankings (passage ids, best first) with a 95 % bootstrap
    interval, and the latency's median and 99th percentile."""
    rng = np.random.default_rng(0)
    result: dict[str, Any] = {}
    for k, found in hits_at(queries, rankings).items():
        result[f"recall_at_{k}"] = round(float(found.mean()), 4)
        result[f"recall_at_{k}_ci"] = [round(end, 4) for end in bootstrap_mean_ci(found, rng)]
    result["query_ms_p50"] = round(statistics.median(latencies) * 1000, 3)
    result["query_ms_p99"] = round(float(np.percentile(np.asarray(latencies) * 1000, 99)), 3)
    return result


def paired(default: Hits, other: Hits) -> dict[str, Any]:
    """``other``'s recall@k minus the default's on the same queries, with a paired interval."""
    rng = np.random.default_rng(0)
    result: dict[str, Any] = {}
    for k in KS:
        difference = other[k] - default[k]
        result[f"recall_at_{k}_diff"] = round(float(difference.mean()), 4)
        result[f"recall_at_{k}_diff_ci"] = [round(end, 4) for end in bootstrap_mean_ci(difference, rng)]
    return result


def timed_build(passages: list[Passage], method: Method, directory: Path) -> tuple[VectorIndex, float, float]:
    """Build (embedder fitting, embedding, BM25, IVF training) and save: the index, wall and CPU s.

    CPU seconds (all threads of this process) say what the build costs when the machine is
    shared: wall time then grows with the other jobs' load, CPU time far less.
    """
    started, cpu_started = time.perf_counter(), time.process_time()
    index = build_index(passages, IndexConfig(embedder=method.fitted), embedder=method.brought())
    save_index(index, directory)
    return index, time.perf_counter() - started, time.process_time() - cpu_started


def methods(args: argparse.Namespace) -> list[Method]:
    """The default first, then the fast embedder; with ``--compare`` the others too."""
    precision = native_precision()
    rows = [Method(f"MiniLM-L6 {precision} (default)"), Method("WordLlama-IDF (fast)", fitted=WORDLLAMA)]
    if not args.compare:
        return rows
    if precision != FLOAT32:
        rows.append(Method("MiniLM-L6 float32", make=lambda: MiniLMEmbedder(minilm_weights(FLOAT32))))
    rows += [
        Method("TF-IDF + SVD 384 (previous default)", fitted=TFIDF_SVD),
        Method(
            "WordLlama, uniform pooling (the package's own)",
            make=lambda: WordLlamaEmbedder(np.ones(token_vectors().table.shape[0])),
        ),
    ]
    if args.sentence_transformers:
        model_dir = Path(args.sentence_transformers)
        rows.append(
            Method(
                f"sentence-transformers {model_dir.name}", make=lambda: SentenceTransformerEmbedder(model_dir)
            )
        )
    return rows


# The default's rrf_k and depth at each of them, and the default without weighing identifiers.
FUSION_SWEEP = [FusionConfig(rrf_k, depth) for rrf_k in (5, 10, 20, 60) for depth in (20, 100)] + [
    FusionConfig(identifier_weight=1)
]


def fusion_sweep(index: VectorIndex, queries: list[Query]) -> list[dict[str, Any]]:
    """Recall of other fusion settings on the same index (one-shot hybrid = the last stage)."""
    chosen = index.fusion
    vectors = [index.embed_query(query.text) for query in queries]
    rows = []
    with one_search_thread():
        for fusion in FUSION_SWEEP:
            index.fusion = fusion
            rankings = [
                distinct_passages(index, index.search(vector, max(KS), query_text=query.text)[1])
                for vector, query in zip(vectors, queries, strict=True)
            ]
            result = scores(queries, rankings, [0.0])
            settings = {
                "rrf_k": fusion.rrf_k,
                "depth": fusion.depth,
                "identifier_weight": fusion.identifier_weight,
            }
            rows.append({**settings, **result})
            print(f"fusion {json.dumps(settings)}: {json.dumps(result)}", flush=True)
    index.fusion = chosen
    return rows


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Each embedder's hybrid index, built once, searched hybrid and by its dense channel alone."""
    passages = load_passages(Path(args.corpus))
    queries = load_queries(Path(args.queries))
    if args.quick:
        passages, queries = quick_subset(passages, queries)
    table: list[dict[str, Any]] = []
    headline: dict[str, Any] = {}
    sweep: list[dict[str, Any]] = []
    default_hits: dict[str, Hits] = {}
    paired_rows: list[dict[str, Any]] = []
    for number, method in enumerate(methods(args)):
        index, build_s, build_cpu_s = timed_build(passages, method, work / f"index-{number}")
        cost = {"index_build_s": round(build_s, 2), "docs_per_s": round(len(passages) / build_s, 1)}
        hybrid, hybrid_hits = evaluate(index, queries, hybrid=True)
        dense, dense_hits = evaluate(index, queries, hybrid=False)
        rows = [(f"hybrid: {method.name} + BM25", hybrid), (f"dense: {method.name}", dense)]
        if number == 0:
            default_hits = {"hybrid": hybrid_hits, "dense": dense_hits}
        else:
            for channel, found in (("hybrid", hybrid_hits), ("dense", dense_hits)):
                row = {"method": method.name, "channel": channel, **paired(default_hits[channel], found)}
                paired_rows.append(row)
                print(f"paired against the default: {json.dumps(row)}", flush=True)
        if number == 0:
            rows.append(("BM25 alone (the lexical channel)", lexical_only(index, queries)))
            if args.compare:
                sweep = fusion_sweep(index, queries)
            headline = {
                **{key: hybrid[key] for key in ("recall_at_1", "recall_at_5", "recall_at_10")},
                "dense_only": dense,
                **cost,
                "query_ms_p50": hybrid["query_ms_p50"],
            }
        for name, result in rows:
            table.append({"method": name, **result, **cost, "index_build_cpu_s": round(build_cpu_s, 2)})
            print(f"{name}: {json.dumps({**result, **cost})}", flush=True)
        del index
    return {
        "headline": headline,
        "table": table,
        "paired": paired_rows,
        "fusion_sweep": sweep,
        "passages": len(passages),
        "queries": len(queries),
    }


def plot(result: dict[str, Any], name: str) -> Path:
    rows = result["table"]
    figure, axis = plt.subplots(figsize=(9, 0.5 * len(rows) + 1.5))
    labels = [row["method"] for row in rows]
    for offset, k in zip((-0.25, 0, 0.25), KS, strict=True):
        recall = np.array([row[f"recall_at_{k}"] for row in rows])
        ends = np.array([row[f"recall_at_{k}_ci"] for row in rows])
        axis.barh(
            np.arange(len(rows)) + offset,
            recall,
            height=0.25,
            xerr=np.abs(ends.T - recall),
            capsize=2,
            label=f"recall@{k} (95 % interval)",
        )
    axis.set_yticks(np.arange(len(rows)), labels)
    axis.invert_yaxis()
    axis.set_xlim(0, 1)
    axis.set_xlabel("recall (answer document among the first k passages)")
    axis.set_title(f"{result['passages']:,} passages, {result['queries']:,} queries")
    axis.legend(loc="lower right")
    path = save_figure(figure, plot_path(name))
    return path


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--corpus", required=True, help="JSONL corpus: {id, title, text} a line")
    parser.add_argument("--queries", required=True, help="JSONL queries: {query, answer_id} a line")
    parser.add_argument("--data-dir", help="where to build the indexes (default: a temporary directory)")
    parser.add_argument(
        "--compare", action="store_true", help="also evaluate the other methods (docs/retrieval.md's table)"
    )
    parser.add_argument(
        "--sentence-transformers", metavar="DIR", help="with --compare: a model directory to add"
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"the first {QUICK_QUERIES} queries, {QUICK_PASSAGES} passages and their answers' passages",
    )
    parser.add_argument("--name", default="retrieval", help="basename of the JSON and PNG in bench/out/")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.data_dir:
        work = Path(args.data_dir) / "bench-retrieval"
        work.mkdir(parents=True, exist_ok=True)
        result = run(args, work)
    else:
        with tempfile.TemporaryDirectory(prefix="bench-retrieval-") as temporary:
            result = run(args, Path(temporary))
    result.update(machine=machine(), corpus=args.corpus, queries_file=args.queries)
    json_path = write_json(args.name, result)
    print(f"wrote {json_path} and {plot(result, args.name)}", flush=True)
    print_summary(result["headline"])


if __name__ == "__main__":
    main()
