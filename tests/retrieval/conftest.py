"""Small synthetic data shared by the retrieval tests (seconds, not minutes, on two cores)."""

from __future__ import annotations

import numpy as np
import pytest

from specrag.retrieval.backends.local.staged_hnsw import StagedHNSW
from specrag.retrieval.backends.local.staged_ivf import StagedIVF
from specrag.retrieval.corpus import Passage
from specrag.retrieval.synthetic import GaussianMixture, queries_near
from tests.helpers.vectors import DIM


@pytest.fixture(scope="session")
def vectors() -> np.ndarray:
    return GaussianMixture(DIM, num_clusters=40, seed=1).sample(6000)


@pytest.fixture(scope="session")
def queries(vectors: np.ndarray) -> np.ndarray:
    return queries_near(vectors, 200, seed=2)


@pytest.fixture(scope="session")
def ivf(vectors: np.ndarray) -> StagedIVF:
    return StagedIVF.build(vectors, nlist=64, nprobe=24)


@pytest.fixture(scope="session")
def hnsw(vectors: np.ndarray) -> StagedHNSW:
    return StagedHNSW.build(vectors, m=16, ef_search=48)


@pytest.fixture(scope="session")
def passages() -> list[Passage]:
    topics = [
        "python lists and tuples",
        "dictionary keys hashing",
        "asyncio event loop tasks",
        "file io paths",
    ]
    return [
        Passage(
            id=f"p{i}",
            title=topics[i % 4],
            text=f"{topics[i % 4]} passage number {i} about {topics[(i * 7) % 4]}",
        )
        for i in range(120)
    ]
