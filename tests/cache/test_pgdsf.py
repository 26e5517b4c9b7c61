import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from specrag.cache import PrefillProfile
from specrag.cache.pgdsf import PgdsfStats
from specrag.errors import InvalidInputError


def test_profile_interpolates_and_extrapolates_linearly() -> None:
    profile = PrefillProfile([(0, 0.0), (1000, 1.0), (2000, 3.0)])
    assert profile.seconds(500) == pytest.approx(0.5)
    assert profile.seconds(3000) == pytest.approx(5.0)
    # computing 1000 tokens behind 1000 cached ones costs more than the first 1000
    assert profile.cost(1000, 1000) == pytest.approx(2.0)
    assert profile.cost(0, 1000) == pytest.approx(1.0)


def test_bad_profiles_are_rejected() -> None:
    for points in ([(0, 0.0)], [(0, 0.0), (0, 1.0)], [(0, 1.0), (10, 0.5)]):
        with pytest.raises(InvalidInputError):
            PrefillProfile(points)


def test_priority_is_clock_plus_frequency_times_mean_miss_cost() -> None:
    stats = PgdsfStats()
    stats.record(clock=1.0, computed_cost_per_token=0.2)
    stats.record(clock=1.0, computed_cost_per_token=0.4)
    stats.record(clock=2.0, computed_cost_per_token=None)  # a hit: counted, no cost sample
    assert stats.priority == pytest.approx(2.0 + 3 * 0.3)


@given(
    st.lists(st.tuples(st.integers(0, 20_000), st.floats(0, 50)), min_size=2, max_size=40),
    st.lists(st.integers(0, 30_000), min_size=1, max_size=40),
)
def test_profile_seconds_are_numpy_interp_s_own_floats(
    points: list[tuple[int, float]], asked: list[int]
) -> None:
    """The plain-float interpolation gives numpy.interp's float exactly (orderings compare costs),
    at the points, between them and before the first; past the last, the last slope."""
    tokens = sorted({t for t, _ in points})
    if len(tokens) < 2:
        return
    seconds = sorted(s for _, s in points)[: len(tokens)]
    profile = PrefillProfile(list(zip(tokens, seconds, strict=True)))
    slope = np.float64(seconds[-1] - seconds[-2]) / np.float64(tokens[-1] - tokens[-2])
    for n in [*asked, *tokens]:
        if n > tokens[-1]:
            expected = float(np.float64(seconds[-1]) + (n - tokens[-1]) * slope)
        else:
            expected = float(np.interp(n, np.array(tokens, dtype=np.float64), np.array(seconds)))
        assert profile.seconds(n) == expected
