from __future__ import annotations

import numpy as np
import pytest

from specrag.errors import InvalidInputError
from specrag.retrieval.synthetic import (
    CHUNK_ROWS,
    GaussianMixture,
    nearest_rows,
    pad_with_synthetic,
    queries_near,
)


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


def test_padding_maps_rows_to_distinct_passages_near_their_anchor() -> None:
    real = GaussianMixture(16, num_clusters=4).sample(50)
    padded, sources = pad_with_synthetic(real, 3000, seed=2, neighbourhood=8)
    assert padded.shape == (3000, 16) and sources.shape == (2950,)
    np.testing.assert_array_equal(padded[:50], real)  # the real rows first, unchanged
    vectors = padded[50:]
    assert sources.min() >= 0 and sources.max() < 50
    # A row stands for a passage near the one it was drawn around, so it is near its passage too.
    similarity_to_source = np.einsum("ij,ij->i", vectors, real[sources])
    assert np.median(similarity_to_source) > np.median(vectors @ real.T)
    # The synthetic rows nearest a real passage stand for several passages, not copies of one:
    # otherwise a padded index's top-k would name a single document.
    nearest = np.argsort(-(vectors @ real[0]))[:10]
    assert len(set(sources[nearest].tolist())) >= 4
    again, again_sources = pad_with_synthetic(real, 3000, seed=2, neighbourhood=8)
    np.testing.assert_array_equal(padded, again)
    np.testing.assert_array_equal(sources, again_sources)
    with pytest.raises(InvalidInputError):
        pad_with_synthetic(real, 10)


def test_nearest_rows_start_with_the_row_itself() -> None:
    vectors = GaussianMixture(8, num_clusters=3).sample(2100)  # more than one 1024-row chunk
    nearest = nearest_rows(vectors, 5)
    assert nearest.shape == (2100, 5)
    assert all(row in nearest[row] for row in range(2100))
    brute = np.argsort(-(vectors @ vectors.T), axis=1)[:, :5]
    agree = np.mean([len(set(a) & set(b)) / 5 for a, b in zip(nearest, brute, strict=True)])
    assert agree > 0.99  # ties aside, the same neighbours as a full sort
