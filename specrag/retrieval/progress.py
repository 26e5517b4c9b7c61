"""Chunked embedding and index insertion with a tqdm bar, so long builds show where they are.

Texts are embedded in order of length (:mod:`specrag.retrieval.embedders.batching`).
"""

from __future__ import annotations

from collections.abc import Sequence

import faiss
import numpy as np
from tqdm import tqdm

from specrag.retrieval.embedders.batching import length_sorted_batches
from specrag.retrieval.embedders.embedder import Embedder
from specrag.retrieval.embedders.embedding_bar import embedding_bar

__all__ = ["ADD_CHUNK_ROWS", "EMBED_BATCH", "add_in_chunks", "embed_in_batches"]

ADD_CHUNK_ROWS = 65_536
EMBED_BATCH = 256


def add_in_chunks(index: faiss.Index, vectors: np.ndarray, show: bool, desc: str = "adding vectors") -> None:
    """``index.add(vectors)`` in chunks, ticking a progress bar when ``show``."""
    with tqdm(total=len(vectors), desc=desc, unit="vec", disable=not show) as bar:
        for start in range(0, len(vectors), ADD_CHUNK_ROWS):
            chunk = np.ascontiguousarray(vectors[start : start + ADD_CHUNK_ROWS], dtype=np.float32)
            index.add(chunk)
            bar.update(len(chunk))


def embed_in_batches(embedder: Embedder, texts: Sequence[str], show: bool) -> np.ndarray:
    """Embed ``texts`` batch by batch (by length) into one (len(texts), dim) float32 array."""
    out = np.empty((len(texts), embedder.dim), dtype=np.float32)
    with embedding_bar(len(texts), show) as bar:
        for rows in length_sorted_batches(texts, EMBED_BATCH):
            out[rows] = embedder.embed([texts[row] for row in rows])
            bar.update(len(rows))
    return out
