"""Unit rows: scikit-learn's normalisation, bit for bit, without its per-call validation."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.preprocessing import normalize

from specrag.retrieval.arrays import unit_rows


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(1, 384), (7, 64), (300, 300)])
def test_unit_rows_are_scikit_learns_normalised_rows_bit_for_bit(
    shape: tuple[int, int], dtype: type[np.floating]
) -> None:
    rng = np.random.default_rng(sum(shape))
    vectors = (rng.standard_normal(shape) * rng.uniform(1e-3, 1e3)).astype(dtype)
    vectors[0] = 0.0  # an all-zero row stays zero
    rows = unit_rows(vectors)
    expected = np.ascontiguousarray(normalize(np.asarray(vectors, dtype=np.float32)), dtype=np.float32)
    assert rows.dtype == np.float32 and rows.flags.c_contiguous and np.array_equal(rows, expected)
    assert not np.shares_memory(rows, vectors)


def test_a_nan_or_infinite_value_is_refused() -> None:
    for bad in (np.nan, np.inf):
        with pytest.raises(ValueError, match="NaN or infinity"):
            unit_rows(np.array([[1.0, bad]], dtype=np.float32))
