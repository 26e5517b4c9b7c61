"""bench.updates' history measurement: the log's bytes, RSS and a start in a fresh process after a
short and a long history of replacements."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.updates.table import TableEmbedder, stand_in_tokens
from specrag.pipeline.store.document_store import build_store
from specrag.pipeline.store.live_corpus import LiveCorpus
from specrag.pipeline.store.live_log import live_log_path
from specrag.pipeline.store.live_store import LiveStore
from specrag.retrieval.backends.local.staged_ivf import StagedIVF
from specrag.retrieval.corpus import Passage
from specrag.retrieval.synthetic import GaussianMixture
from specrag.retrieval.vector_index import VectorIndex

HISTORY_PASSAGES = 2000
HISTORY_DOCUMENTS = 100
HISTORY_REPLACEMENTS = 10_000
# A replacement's text: about a kilobyte of words, then the ``vec:<n>`` that names its vector.
HISTORY_WORDS = "the words of a document that is replaced again and again " * 18


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
    code = f"from bench.updates.history import start_up; start_up({str(store_path)!r}, *{shape!r})"
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
