"""Synthetic vectors for search-time experiments at scales the real corpus cannot reach.

Search cost grows with the vectors scanned, so measuring staged search where it matters (a search
of tens of milliseconds) needs millions of vectors. Two sources: a Gaussian mixture with queries
near data points, and padding of a real index with vectors drawn around the real embeddings, each
synthetic row standing for a passage of its anchor's neighbourhood so any hit still names a
relevant passage (see :func:`pad_with_synthetic`).
Everything is deterministic from a seed and generated chunk by chunk into one float32 array, so
1M × 384 needs its 1.5 GB and little more.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specrag.errors import InvalidInputError
from specrag.retrieval.arrays import unit_rows

__all__ = [
    "CHUNK_ROWS",
    "DEFAULT_QUERY_NOISE",
    "DEFAULT_SPREAD",
    "PADDING_VERSION",
    "PAD_NEIGHBOURHOOD",
    "GaussianMixture",
    "nearest_rows",
    "pad_with_synthetic",
    "queries_near",
]

# Fixed so that the output for a seed does not depend on anything but (n, dim, parameters).
CHUNK_ROWS = 65_536
# How many real passages around its anchor a synthetic row may stand for (about 2k-3k for k<=10).
PAD_NEIGHBOURHOOD = 16
# Bumped whenever padding changes what a synthetic row stands for: cached padded indexes are keyed by it.
PADDING_VERSION = 2
# Noise above the centre separation makes clusters overlap, as clusters of real embeddings do; with
# well-separated clusters every index is exact after its first probe and staging shows nothing.
DEFAULT_SPREAD = 1.5
DEFAULT_QUERY_NOISE = 1.0


@dataclass(frozen=True)
class GaussianMixture:
    """Unit vectors around ``num_clusters`` random centres; ``spread`` is the noise-to-centre ratio."""

    dim: int
    num_clusters: int = 1024
    spread: float = DEFAULT_SPREAD
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dim < 1 or self.num_clusters < 1 or self.spread < 0:
            raise InvalidInputError(f"invalid mixture {self}")

    def centres(self) -> np.ndarray:
        rng = np.random.default_rng([self.seed, 0])
        return unit_rows(rng.standard_normal((self.num_clusters, self.dim), dtype=np.float32))

    def sample(self, num: int) -> np.ndarray:
        """``num`` unit vectors (float32, shape (num, dim)); ``sample(m)`` is a prefix of ``sample(n)``."""
        if num < 0:
            raise InvalidInputError(f"num must be non-negative, got {num}")
        centres = self.centres()
        noise_scale = self.spread / np.sqrt(self.dim)
        out = np.empty((num, self.dim), dtype=np.float32)
        for chunk, start in enumerate(range(0, num, CHUNK_ROWS)):
            rows = min(CHUNK_ROWS, num - start)
            # Separate streams for noise and cluster choice keep sample(m) a prefix of sample(n).
            block = np.random.default_rng([self.seed, 1, chunk]).standard_normal(
                (rows, self.dim), dtype=np.float32
            )
            block *= noise_scale
            block += centres[
                np.random.default_rng([self.seed, 4, chunk]).integers(0, self.num_clusters, size=rows)
            ]
            out[start : start + rows] = unit_rows(block)
        return out


def queries_near(
    vectors: np.ndarray, num: int, noise: float = DEFAULT_QUERY_NOISE, seed: int = 0
) -> np.ndarray:
    """Unit queries each near a random data point (relative noise ``noise``), as users' queries are."""
    if len(vectors) == 0:
        raise InvalidInputError("cannot draw queries near an empty set of vectors")
    rng = np.random.default_rng([seed, 2])
    anchors = vectors[rng.integers(0, len(vectors), size=num)]
    jitter = rng.standard_normal(anchors.shape, dtype=np.float32) * (noise / np.sqrt(vectors.shape[1]))
    return unit_rows(anchors + jitter)


def pad_with_synthetic(
    real: np.ndarray, total: int, noise: float = 0.5, seed: int = 0, neighbourhood: int = PAD_NEIGHBOURHOOD
) -> tuple[np.ndarray, np.ndarray]:
    """``real`` padded to ``total`` rows (real rows first), and the real row each synthetic one stands for.

    One array holds both, so padding to n rows takes n rows of memory, not twice that.

    Each synthetic vector is a random real embedding (its anchor) plus Gaussian noise scaled by
    the real embeddings' per-dimension spread, so the padded index keeps the real data's geometry
    and search cost per vector. It stands for a random passage among the anchor's
    ``neighbourhood`` nearest real ones (the anchor included), not for the anchor itself: with
    hundreds of synthetic rows per passage, a query's top-k would otherwise be copies of one or
    two passages, and every prompt would hold a single document. This way a query near passage A
    retrieves k distinct passages from A's real neighbourhood, and queries on related passages
    share documents the way real retrieval makes them.
    """
    num_real, dim = real.shape
    if num_real == 0:
        raise InvalidInputError("cannot pad an empty index")
    if total < num_real:
        raise InvalidInputError(f"cannot pad {num_real} vectors down to {total}")
    if neighbourhood < 1:
        raise InvalidInputError(f"neighbourhood must be at least 1, got {neighbourhood}")
    neighbours = nearest_rows(real, min(neighbourhood, num_real))
    scale = (noise * real.std(axis=0)).astype(np.float32)
    count = total - num_real
    padded = np.empty((total, dim), dtype=np.float32)
    padded[:num_real] = real
    vectors = padded[num_real:]
    sources = np.empty(count, dtype=np.int64)
    for chunk, start in enumerate(range(0, count, CHUNK_ROWS)):
        rows = min(CHUNK_ROWS, count - start)
        rng = np.random.default_rng([seed, 3, chunk])
        anchors = rng.integers(0, num_real, size=rows)
        block = rng.standard_normal((rows, dim), dtype=np.float32) * scale
        block += real[anchors]
        vectors[start : start + rows] = unit_rows(block)
        sources[start : start + rows] = neighbours[anchors, rng.integers(0, neighbours.shape[1], size=rows)]
    return padded, sources


def nearest_rows(vectors: np.ndarray, m: int) -> np.ndarray:
    """For each row, the indices of its ``m`` most similar rows (inner product), itself included."""
    result = np.empty((len(vectors), m), dtype=np.int64)
    for start in range(0, len(vectors), 1024):  # bounded memory: 1024 x n similarities at a time
        similarity = vectors[start : start + 1024] @ vectors.T
        np.fill_diagonal(similarity[:, start:], np.inf)  # a row is its own nearest neighbour
        result[start : start + 1024] = np.argpartition(-similarity, m - 1, axis=1)[:, :m]
    return result
