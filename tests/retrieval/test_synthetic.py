from __future__ import annotations

import numpy as np
import pytest

from specrag.errors import InvalidInputError
from specrag.retrieval.synthetic import CHUNK_ROWS, GaussianMixture, pad_with_synthetic, queries_near


def test_mixture_is_deterministic_and_unit_length() -> None:
    mixture = GaussianMixture(16, num_clusters=8, seed=5)
    first = mixture.sample(CHUNK_ROWS + 10)
    np.testing.assert_array_equal(first, mixture.sample(CHUNK_ROWS + 10))
    np.testing.assert_array_equal(first[:100], mixture.sample(100))
    assert not np.array_equal(first[:100], GaussianMixture(16, num_clusters=8, seed=6).sample(100))
    np.testing.assert_allclose(np.linalg.norm(first, axis=1), 1.0, rtol=1e-5)


def test_queries_are_near_data_points() -> None:
    data = GaussianMixture(32, num_clusters=4).sample(500)
    queries = queries_near(data, 20, noise=0.1, seed=1)
    np.testing.assert_array_equal(queries, queries_near(data, 20, noise=0.1, seed=1))
    assert (queries @ data.T).max(axis=1).min() > 0.8


def test_padding_maps_rows_to_their_source_passage() -> None:
    real = GaussianMixture(16, num_clusters=4).sample(50)
    vectors, sources = pad_with_synthetic(real, 300, seed=2)
    assert vectors.shape == (250, 16) and sources.shape == (250,)
    assert sources.min() >= 0 and sources.max() < 50
    similarity_to_source = np.einsum("ij,ij->i", vectors, real[sources])
    assert np.median(similarity_to_source) > np.median(vectors @ real.T)
    again, again_sources = pad_with_synthetic(real, 300, seed=2)
    np.testing.assert_array_equal(vectors, again)
    np.testing.assert_array_equal(sources, again_sources)
    with pytest.raises(InvalidInputError):
        pad_with_synthetic(real, 10)
