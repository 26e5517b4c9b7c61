import pytest

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
