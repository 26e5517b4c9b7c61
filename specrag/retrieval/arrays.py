"""Arrays every embedder shares: unit rows, and ``.npy`` files read safely.

A leaf module of its own so that the embedder modules (:mod:`specrag.retrieval.embedders.wordllama_embedder`,
:mod:`specrag.retrieval.embedders.http_embedder`), which :mod:`specrag.retrieval.embedders.embedder` loads by
kind, do not import that module back.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from sklearn.preprocessing import normalize

from specrag.errors import ArtifactError

__all__ = ["load_array", "unit_rows"]


def unit_rows(vectors: np.ndarray) -> np.ndarray:
    """Rows scaled to unit length (all-zero rows stay zero) as C-contiguous float32."""
    return np.ascontiguousarray(normalize(np.asarray(vectors, dtype=np.float32)), dtype=np.float32)


def load_array(path: Path) -> np.ndarray:
    """``np.load`` without pickles, turning a missing or damaged file into an ArtifactError."""
    try:
        array: np.ndarray = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as error:
        raise ArtifactError(f"cannot read array file {path}: {error}") from error
    return array
