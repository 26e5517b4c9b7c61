"""Retrieval quality and cost of the default index on a corpus with known answers.

``python -m bench.retrieval --corpus CORPUS.jsonl --queries QUERIES.jsonl [--data-dir DIR]``
builds the default index (``IndexConfig()``: WordLlama + BM25, staged IVF) over the corpus
(``{"id", "title", "text"}`` a line), runs every query (``{"query", "answer_id"}`` a line) through
embedding and the staged search as the service does (its default stages, the query's text
given, so hybrid), and scores recall@1/5/10: a query counts as found at k when one of the first
k passages belongs to the document ``answer_id`` (its id is ``answer_id`` or starts with
``answer_id#``). The dense channel alone is scored on the same index. The last line printed is
one JSON object: ``{"recall_at_1", "recall_at_5", "recall_at_10", "dense_only": {...}, "index_build_s",
"docs_per_s", "query_ms_p50"}``.

``--compare`` adds the table of docs/retrieval.md: the previous default (TF-IDF + SVD), WordLlama with the
package's uniform pooling and, with ``--sentence-transformers DIR``, a sentence-transformers model
directory, each dense and hybrid (one index per embedder, searched both ways), BM25 alone, and
the default index's recall under other fusion settings (``rrf_k`` × depth). Results go to
``bench/out/retrieval.json`` and ``bench/out/retrieval.png``. Evaluation sets: ``bench.retrieval.sets``.
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

from bench.common import machine, plot_path, print_summary, save_figure, write_json
from bench.indexes import distinct_passages, one_search_thread
from bench.traces import read_trace_lines
from specrag.errors import InvalidInputError
from specrag.retrieval.corpus import Passage, load_passages
from specrag.retrieval.embedders import Embedder, SentenceTransformerEmbedder
from specrag.retrieval.fusion import FusionConfig
from specrag.retrieval.index_store import TFIDF_SVD, WORDLLAMA, IndexConfig, build_index, save_index
from specrag.retrieval.vector_index import VectorIndex
from specrag.retrieval.wordllama_embedder import WordLlamaEmbedder, token_vectors

KS = (1, 5, 10)


@dataclass(frozen=True)
class Query:
    text: str
    answer_id: str


@dataclass(frozen=True)
class Method:
    """One embedder of the comparison: fitted on the corpus (by kind) or built by ``make``."""

    name: str
    fitted: str = WORDLLAMA
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


def evaluate(index: VectorIndex, queries: list[Query], hybrid: bool) -> dict[str, Any]:
    """Recall@k and per-query latency (embed + every stage of the search) for one index."""
    with one_search_thread():
        return _evaluate(index, queries, hybrid)


def _evaluate(index: VectorIndex, queries: list[Query], hybrid: bool) -> dict[str, Any]:
    rankings, latencies = [], []
    plan = index.stage_plan()
    for query in queries:
        started = time.perf_counter()
        vector = index.embed_query(query.text)
        *_, last = index.search_staged(vector, max(KS), plan, query_text=query.text if hybrid else None)
        latencies.append(time.perf_counter() - started)
        rankings.append(distinct_passages(index, last.ids))
    return scores(queries, rankings, latencies)


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


def scores(queries: list[Query], rankings: list[list[str]], latencies: list[float]) -> dict[str, Any]:
    """Recall@k over the queries' rankings (passage ids, best first) and the median latency."""
    result: dict[str, Any] = {
        f"recall_at_{k}": round(
            sum(
                any(belongs(p, query.answer_id) for p in ranking[:k])
                for query, ranking in zip(queries, rankings, strict=True)
            )
            / len(queries),
            4,
        )
        for k in KS
    }
    result["query_ms_p50"] = round(statistics.median(latencies) * 1000, 3)
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
    """The default first; with ``--compare`` the other embedders, each dense and hybrid."""
    rows = [Method("WordLlama-IDF (default)")]
    if not args.compare:
        return rows
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
    table: list[dict[str, Any]] = []
    headline: dict[str, Any] = {}
    sweep: list[dict[str, Any]] = []
    for number, method in enumerate(methods(args)):
        index, build_s, build_cpu_s = timed_build(passages, method, work / f"index-{number}")
        cost = {"index_build_s": round(build_s, 2), "docs_per_s": round(len(passages) / build_s, 1)}
        hybrid = evaluate(index, queries, hybrid=True)
        dense = evaluate(index, queries, hybrid=False)
        rows = [(f"hybrid: {method.name} + BM25", hybrid), (f"dense: {method.name}", dense)]
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
        "fusion_sweep": sweep,
        "passages": len(passages),
        "queries": len(queries),
    }


def plot(result: dict[str, Any], name: str) -> Path:
    rows = result["table"]
    figure, axis = plt.subplots(figsize=(9, 0.5 * len(rows) + 1.5))
    labels = [row["method"] for row in rows]
    for offset, k in zip((-0.25, 0, 0.25), KS, strict=True):
        axis.barh(
            np.arange(len(rows)) + offset,
            [row[f"recall_at_{k}"] for row in rows],
            height=0.25,
            label=f"recall@{k}",
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
