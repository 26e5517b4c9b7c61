"""Building a sharded index: one coarse quantizer trained on the whole corpus, shared by N shards.

faiss's answer to a corpus larger than one machine (``IndexShards`` over IVF indexes with one
quantizer) is followed, not used: the shards must be searchable in stages and live apart. The
quantizer is trained once on a sample of every vector, then each shard is a copy of the trained,
empty index holding the rows it owns (:func:`~specrag.retrieval.backends.shards.merge.split_rows`) under
their global row numbers. An HNSW shard is a graph of its own rows.
"""

from __future__ import annotations

import hashlib
from typing import Any

import faiss
import numpy as np

from specrag.retrieval.backends.local.staged_ivf import DEFAULT_NLIST, StagedIVF
from specrag.retrieval.backends.shards.merge import ShardedSearcher, split_rows

__all__ = ["build_hnsw_shards", "build_ivf_shards", "quantizer_digest"]


def quantizer_digest(ivf: StagedIVF) -> str:
    """A checksum of the coarse quantizer's centroids (and their count and dimension): equal in
    every shard of one index, and different once any centroid differs."""
    quantizer: Any = ivf.index.quantizer
    centroids = np.ascontiguousarray(quantizer.reconstruct_n(0, quantizer.ntotal), dtype=np.float32)
    digest = hashlib.sha256(f"{centroids.shape[0]}x{centroids.shape[1]}:{ivf.index.metric_type}\n".encode())
    digest.update(centroids.tobytes())
    return digest.hexdigest()


def build_ivf_shards(
    vectors: np.ndarray,
    shards: int,
    *,
    nlist: int = DEFAULT_NLIST,
    nprobe: int | None = None,
    codes: str = "flat",
    pq_m: int = 16,
    seed: int = 0,
) -> ShardedSearcher:
    """IVF shards of ``vectors`` sharing one quantizer, trained as an unsharded build trains
    (same sample, same seed), so that the shards' merged search equals that index's."""
    parts = split_rows(len(vectors), shards)
    trained = StagedIVF.build(
        vectors, nlist=nlist, nprobe=nprobe, codes=codes, pq_m=pq_m, seed=seed, add=False
    )
    searchers = []
    for rows in parts:
        shard = StagedIVF(faiss.clone_index(trained.owner), trained.nprobe, next_row=len(vectors))
        shard.add_rows(vectors[rows], rows, len(vectors))
        searchers.append(shard)
    keep_max = trained.index.metric_type == faiss.METRIC_INNER_PRODUCT
    return ShardedSearcher(searchers, quantizer_digest(trained), keep_max)


def build_hnsw_shards(
    vectors: np.ndarray, shards: int, *, m: int = 32, ef_construction: int = 40, ef_search: int = 128
) -> ShardedSearcher:
    """One HNSW graph per shard, each over the rows it owns."""
    from specrag.retrieval.backends.local.staged_hnsw import StagedHNSW  # numba: see index_store._staged_hnsw

    searchers = [
        StagedHNSW.build(
            np.ascontiguousarray(vectors[rows]),
            m=m,
            ef_construction=ef_construction,
            ef_search=ef_search,
            rows=rows,
            next_row=len(vectors),
        )
        for rows in split_rows(len(vectors), shards)
    ]
    return ShardedSearcher(searchers, None, keep_max=searchers[0].inner_product)
