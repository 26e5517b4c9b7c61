"""Hybrid recall of a pgvector table with each lexical channel: PostgreSQL's full-text search or BM25.

Part of ``python -m bench.retrieval.pgvector`` (its ``lexical`` key; ``--no-overlap`` skips the
engine part, which this does not need). For each of bench.retrieval's evaluation sets
(:mod:`bench.retrieval.sets`: the manual pages and the standard library's docstrings) it embeds
the corpus as ``index build`` does, loads it into a throwaway server's table
(:class:`~specrag.retrieval.backends.pgvector.local_server.LocalPostgres`), serves it twice as
``serve --backend pgvector`` would, ``--pg-lexical fts`` and ``--pg-lexical bm25``, and runs
every query through the staged hybrid search at the index's default stages. Per set and channel:
recall@1/5/10 with 95 % bootstrap intervals over the questions, the paired difference fts - bm25
with its interval (the channels are a tie at k when it holds 0), and the lexical channel's own
latency per query, p50 and p99 (the full-text query on a ready connection, one round trip; BM25's
search in process). ``--quick`` scores the first :data:`QUICK_QUERIES` questions of each set.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import pyplot as plt
from psycopg import sql

from bench.common import save_figure
from bench.indexes import distinct_passages
from bench.retrieval.__main__ import belongs
from bench.retrieval.conversations import KS, paired, recall
from bench.retrieval.sets import EvaluationSet, manpages_set, pydoc_set
from specrag.cli import build_parser
from specrag.retrieval.backends.pgvector.assembly import open_table
from specrag.retrieval.backends.pgvector.backend import serve_settings
from specrag.retrieval.backends.pgvector.config import LexicalChannel, PgSettings
from specrag.retrieval.backends.pgvector.fulltext import fulltext_query
from specrag.retrieval.backends.pgvector.local_server import LocalPostgres
from specrag.retrieval.backends.pgvector.table import load_table
from specrag.retrieval.backends.registry import around
from specrag.retrieval.embedders.embedder import Embedder
from specrag.retrieval.index_store import IndexConfig
from specrag.retrieval.text import normalize_text
from specrag.retrieval.vector_index import VectorIndex

__all__ = ["draw_lexical", "measure_lexical"]

QUICK_QUERIES = 150
SETS = {"manpages": manpages_set, "pydoc": pydoc_set}


def _rank(index: VectorIndex, vector: np.ndarray, text: str, answer_id: str) -> int:
    """The 1-based rank of the first passage of ``answer_id`` in the staged hybrid top max(KS), 0 if none."""
    *_, last = index.search_staged(vector, max(KS), query_text=text, learn=False)
    ranked = distinct_passages(index, last.ids)
    return next((rank for rank, passage in enumerate(ranked, 1) if belongs(passage, answer_id)), 0)


def _lexical_s(index: VectorIndex, settings: PgSettings, channel: LexicalChannel, text: str) -> float:
    """One query's lexical ranking alone: the full-text query's round trip, or BM25 in process."""
    depth = index.fusion.depth
    if channel is LexicalChannel.BM25:
        assert index.lexical is not None
        started = time.perf_counter()
        index.lexical.search(text, depth, index.fusion.identifier_weight)
        return time.perf_counter() - started
    database = index.searcher.database  # type: ignore[attr-defined]
    with database.connection() as connection:
        query = fulltext_query(settings, sql.SQL("1"))
        connection.execute(query, {"t": text, "n": depth}, prepare=True).fetchall()  # planned once
        started = time.perf_counter()
        connection.execute(query, {"t": text, "n": depth}, prepare=True).fetchall()
        return time.perf_counter() - started


def _measure_set(
    server: LocalPostgres, name: str, evaluation: EvaluationSet, queries: int, rng: np.random.Generator
) -> dict[str, Any]:
    passages, questions = evaluation.passages, evaluation.queries[:queries]
    texts = [normalize_text(f"{passage.title}\n{passage.text}") for passage in passages]
    config = IndexConfig()
    embedder: Embedder
    embedder, vectors = config.fit_and_embed(texts)
    settings = PgSettings(server.dsn, table=f"lexical_{name}")
    load_table(settings, passages, vectors, nlist=config.nlist)
    result: dict[str, Any] = {"passages": len(passages), "queries": len(questions)}
    ranks: dict[str, np.ndarray] = {}
    for channel in LexicalChannel:
        flags = ["--backend", "pgvector", "--pg-dsn", settings.dsn, "--pg-table", settings.table]
        args = build_parser().parse_args(["serve", *flags, "--pg-lexical", str(channel)])
        index = around(open_table(serve_settings(args), lambda name, texts: embedder))
        try:
            found, latencies = [], []
            for question in questions:
                vector = index.embed_query(question["query"])
                found.append(_rank(index, vector, question["query"], question["answer_id"]))
                latencies.append(_lexical_s(index, settings, channel, question["query"]))
        finally:
            index.searcher.close()  # type: ignore[attr-defined]
        ranks[str(channel)] = np.array(found)
        result[str(channel)] = {
            **recall(ranks[str(channel)], rng),
            "lexical_ms_p50": round(statistics.median(latencies) * 1000, 3),
            "lexical_ms_p99": round(float(np.percentile(latencies, 99)) * 1000, 3),
        }
    result["fts_minus_bm25"] = paired(ranks["bm25"], ranks["fts"], rng)
    return result


def measure_lexical(quick: bool) -> dict[str, Any]:
    """Every set's figures (the module's docstring)."""
    rng = np.random.default_rng(0)
    with LocalPostgres() as server:
        sets = {
            name: _measure_set(server, name, make(), QUICK_QUERIES if quick else 10**9, rng)
            for name, make in SETS.items()
        }
    return {"sets": sets}


def draw_lexical(result: dict[str, Any], path: Path) -> Path:
    """recall@k of each set and channel with its interval."""
    figure, axis = plt.subplots(figsize=(9, 4))
    rows = [(name, channel) for name in result["sets"] for channel in LexicalChannel]
    positions = np.arange(len(rows))
    for offset, k in zip((-0.25, 0.0, 0.25), KS, strict=True):
        scored = [result["sets"][name][str(channel)] for name, channel in rows]
        values = np.array([row[f"recall_at_{k}"] for row in scored])
        errors = np.abs(np.array([row[f"recall_at_{k}_ci"] for row in scored]).T - values)
        axis.barh(positions + offset, values, height=0.25, xerr=errors, label=f"recall@{k}")
    axis.set_yticks(positions, [f"{name}, {channel}" for name, channel in rows])
    axis.invert_yaxis()
    axis.set_xlim(0, 1)
    axis.set_xlabel("answer among the first k passages, fused hybrid (95 % interval)")
    axis.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return save_figure(figure, path)
