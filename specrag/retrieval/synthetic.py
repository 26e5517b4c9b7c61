"""Synthetic vectors for search-time experiments at scales the real corpus cannot reach.

Search cost grows with the vectors scanned, so measuring staged search where it matters (a search
of tens of milliseconds) needs millions of vectors. Two sources: a Gaussian mixture with queries
near data points, and padding of a real index with vectors drawn around the real embeddings, each
synthetic row mapped to the real passage it was drawn from so any hit still names a passage.
Everything is deterministic from a seed and generated chunk by chunk into one float32 array, so
1M × 384 needs its 1.5 GB and little more.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specrag.errors import InvalidInputError
from specrag.retrieval.embedders import unit_rows

# Fixed so that the output for a seed does not depend on anything but (n, dim, parameters).
CHUNK_ROWS = 65_536
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
    real: np.ndarray, total: int, noise: float = 0.5, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """Vectors for rows ``len(real)..total-1`` and the real row each was drawn around.

    Each synthetic vector is a random real embedding plus Gaussian noise scaled by the real
    embeddings' per-dimension spread, so the padded index keeps the real data's geometry (and
    search cost per vector) while a hit on a synthetic row maps back to a real passage.
    """
    num_real, dim = real.shape
    if num_real == 0:
        raise InvalidInputError("cannot pad an empty index")
    if total < num_real:
        raise InvalidInputError(f"cannot pad {num_real} vectors down to {total}")
    scale = (noise * real.std(axis=0)).astype(np.float32)
    count = total - num_real
    vectors = np.empty((count, dim), dtype=np.float32)
    sources = np.empty(count, dtype=np.int64)
    for chunk, start in enumerate(range(0, count, CHUNK_ROWS)):
        rows = min(CHUNK_ROWS, count - start)
        rng = np.random.default_rng([seed, 3, chunk])
        sources[start : start + rows] = rng.integers(0, num_real, size=rows)
        block = rng.standard_normal((rows, dim), dtype=np.float32) * scale
        block += real[sources[start : start + rows]]
        vectors[start : start + rows] = unit_rows(block)
    return vectors, sources
