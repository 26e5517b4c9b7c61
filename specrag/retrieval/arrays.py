"""Arrays every embedder shares: unit rows, and ``.npy`` files read safely.

A leaf module of its own so that the embedder modules (:mod:`specrag.retrieval.embedders.wordllama_embedder`,
:mod:`specrag.retrieval.embedders.http_embedder`), which :mod:`specrag.retrieval.embedders.embedder` loads by
kind, do not import that module back.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from specrag.errors import ArtifactError

__all__ = ["load_array", "unit_rows"]


_NEAR_ZERO = 10 * np.finfo(np.float32).eps
"""A row whose length is below this is left as it is (an all-zero row stays zero)."""


def unit_rows(vectors: np.ndarray) -> np.ndarray:
    """Rows scaled to unit length (all-zero rows stay zero) as a new C-contiguous float32 array;
    ValueError for a NaN or infinite value.

    The same arithmetic as scikit-learn's ``normalize`` (float32 row norms by ``einsum``, a norm
    under :data:`_NEAR_ZERO` taken as 1), so vectors are bit for bit what they were, without its
    argument validation, which cost about half a millisecond a call: once per served question.
    """
    rows = np.array(vectors, dtype=np.float32, order="C", ndmin=2)
    if not np.isfinite(rows).all():
        raise ValueError("vectors to normalise contain NaN or infinity")
    norms = np.sqrt(np.einsum("ij,ij->i", rows, rows))
    norms[norms < _NEAR_ZERO] = 1.0
    rows /= norms[:, np.newaxis]
    return rows


def load_array(path: Path) -> np.ndarray:
    """``np.load`` without pickles, turning a missing or damaged file into an ArtifactError."""
    try:
        array: np.ndarray = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as error:
        raise ArtifactError(f"cannot read array file {path}: {error}") from error
    return array
