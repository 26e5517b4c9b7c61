"""Synthetic vectors for the retrieval tests: their dimension, the pgvector table's lists and
probes, and passages standing for vectors."""

from __future__ import annotations

import numpy as np

from specrag.retrieval.corpus import Passage

DIM = 32  # of tests/retrieval's session vectors (its conftest), which the pgvector tests load too
LISTS = 64  # the pgvector table's IVF lists
PROBES = 24


def passages_for(vectors: np.ndarray) -> list[Passage]:
    """One passage a vector, ids sorting as the rows do (the searcher numbers rows by sorted id)."""
    return [Passage(f"p{row:05d}", f"title {row}", f"text of passage {row}") for row in range(len(vectors))]
