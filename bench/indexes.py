"""The indexes the benchmarks search: padded to a size, searched on one thread, read as passages.

Several families share these (``bench.e2e`` and ``bench.pipeline`` the padded indexes,
``bench.retrieval``'s scripts the one-thread search and the passages of a result); each lives
here once rather than in one family's command that the others import.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import faiss
import numpy as np

from specrag.paths import DataLayout
from specrag.retrieval.index_store import IndexConfig
from specrag.retrieval.synthetic import PADDING_VERSION
from specrag.retrieval.vector_index import VectorIndex
from specrag.service.run.assets import Assets, ensure_index


def scaled_index(layout: DataLayout, assets: Assets, size: int, nlist: int, kind: str = "ivf") -> VectorIndex:
    """The real passages' vectors padded with synthetic ones (each mapped to a passage) to ``size``.

    ``kind`` is an IVF kind of index_store.KINDS; its directory is named after it (flat IVF's keeps
    the name it has always had, so indexes built before remain in use).
    """
    codes = "" if kind == "ivf" else f"-{kind}"
    directory = layout.root / f"index-scaled{codes}-{size}-{nlist}-p{PADDING_VERSION}"
    print(f"padded {kind} index ({size:,} vectors) in {directory}: built if missing or stale (minutes)")
    config = IndexConfig(kind=kind, nlist=nlist, pad_to=size)
    return ensure_index(layout, assets.passages, config, directory)


def distinct_passages(index: VectorIndex, ids: np.ndarray) -> list[str]:
    """Passage ids of a stage's result in rank order, padding and repeats dropped."""
    seen: list[str] = []
    for passage_id in index.passage_ids_of(ids):
        if passage_id not in seen:
            seen.append(passage_id)
    return seen


@contextlib.contextmanager
def one_search_thread() -> Iterator[None]:
    """Queries on one faiss thread, as the service's search runner runs them.

    A single query gains nothing from OpenMP, and on a small shared machine the idle threads'
    spin-waiting competes with the query itself: 2 threads made a 1 ms search take 10-40 ms
    whenever other jobs ran. Builds keep every core.
    """
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    try:
        yield
    finally:
        faiss.omp_set_num_threads(threads)
