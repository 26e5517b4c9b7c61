"""The online prefill-profile fit: recovers known costs, keeps the fallback until it has enough."""

from __future__ import annotations

import random

import pytest

from specrag.cache import KnowledgeTree, PrefillEstimator, PrefillProfile
from specrag.cache.prefill_estimator import REFIT_EVERY
from specrag.errors import InvalidInputError
from tests.helpers.tree import BLOCK, SYSTEM, layout

FALLBACK = PrefillProfile()


def synthetic(
    a: float, b: float, overhead_s: float, count: int, seed: int = 0
) -> list[tuple[int, int, float]]:
    """Served requests of an engine whose cold prefill of n tokens takes a·n + b·n² (+ overhead)."""
    rng = random.Random(seed)
    points = []
    for _ in range(count):
        cached, computed = rng.randrange(0, 2048, 16), rng.randrange(1, 2048)
        seconds = overhead_s + a * computed + b * ((cached + computed) ** 2 - cached**2)
        points.append((cached, computed, seconds))
    return points


def fitted(points: list[tuple[int, int, float]]) -> PrefillProfile:
    estimator = PrefillEstimator(FALLBACK, min_samples=8)
    for point in points:
        estimator.record(*point)
    return estimator.profile


def test_a_known_linear_cost_is_recovered() -> None:
    profile = fitted(synthetic(a=3e-4, b=0.0, overhead_s=0.02, count=40))
    assert profile.measured
    for cached, computed in [(0, 100), (512, 1000), (1500, 40)]:
        assert profile.cost(cached, computed) == pytest.approx(3e-4 * computed, rel=1e-3)


def test_an_attention_term_is_recovered_and_makes_cached_context_dearer() -> None:
    profile = fitted(synthetic(a=1e-4, b=2e-7, overhead_s=0.0, count=60))
    for cached, computed in [(0, 256), (1024, 256), (2000, 1000)]:
        expected = 1e-4 * computed + 2e-7 * ((cached + computed) ** 2 - cached**2)
        # piecewise-linear samples of the quadratic: close, not exact
        assert profile.cost(cached, computed) == pytest.approx(expected, rel=0.05)
    assert profile.cost(1024, 256) > profile.cost(0, 256)


def test_the_fallback_stands_until_there_are_enough_samples() -> None:
    estimator = PrefillEstimator(FALLBACK, min_samples=5)
    points = synthetic(a=3e-4, b=0.0, overhead_s=0.0, count=5)
    for point in points[:4]:
        assert estimator.record(*point) is None
    assert estimator.profile is FALLBACK and not estimator.profile.measured
    assert estimator.record(0, 0, 0.5) is None  # nothing computed: no information, not counted
    assert estimator.samples == 4
    measured = estimator.record(*points[4])
    assert measured is not None and estimator.profile is measured and measured.measured


def test_bad_samples_and_settings_are_rejected() -> None:
    estimator = PrefillEstimator(FALLBACK)
    for bad in [(-1, 10, 0.1), (0, -5, 0.1), (0, 10, -0.1), (0, 10, float("nan"))]:
        with pytest.raises(InvalidInputError):
            estimator.record(*bad)
    with pytest.raises(InvalidInputError):
        PrefillEstimator(FALLBACK, min_samples=1)
    with pytest.raises(InvalidInputError):
        PrefillEstimator(FALLBACK, min_samples=10, window=5)


def test_times_that_do_not_grow_with_tokens_give_no_profile() -> None:
    estimator = PrefillEstimator(FALLBACK, min_samples=4)
    for computed in (10, 200, 800, 1600):  # slower for fewer tokens: no non-negative cost fits
        estimator.record(0, computed, 1.0 / computed)
    assert estimator.profile is FALLBACK


def test_the_tree_costs_misses_with_the_profile_it_is_given() -> None:
    steep = PrefillProfile([(0, 0.0), (100, 5.0)], measured=True)
    tree = KnowledgeTree(SYSTEM, block_size=BLOCK)
    tree.use_profile(steep)
    served = layout([3, 1])
    tree.record_served(served, cached_tokens=0)
    node = tree.root.children[3]
    computed = len(served.token_ids)
    assert tree.profile is steep
    assert node.pgdsf.priority == pytest.approx(steep.cost(0, computed) / computed)


def test_a_full_window_fits_exactly_as_its_newest_points_alone() -> None:
    """The points kept in a ring, read back oldest first: the fit is the same floats as a fit of
    the window's points given alone, in their order (both last refitted at their last point)."""
    points = synthetic(3e-4, 2e-8, 0.01, 8 * REFIT_EVERY, seed=3)
    window = 16
    ringed = PrefillEstimator(FALLBACK, min_samples=8, window=window)
    for point in points:
        ringed.record(*point)
    alone = PrefillEstimator(FALLBACK, min_samples=8, window=window)
    for point in points[-window:]:
        alone.record(*point)
    assert ringed.samples == alone.samples == window
    assert ringed.overhead_s == alone.overhead_s
    assert [ringed.profile.seconds(n) for n in range(0, 6000, 37)] == [
        alone.profile.seconds(n) for n in range(0, 6000, 37)
    ]


def test_once_settled_the_profile_is_refitted_every_few_answers_not_after_each() -> None:
    estimator = PrefillEstimator(FALLBACK, min_samples=4)
    refitted = [estimator.record(*point) is not None for point in synthetic(3e-4, 0.0, 0.01, 40)]
    settled = 2 * estimator.min_samples  # a refit after every point until then
    assert all(refitted[estimator.min_samples - 1 : settled])
    later = [count for count, fit in enumerate(refitted[settled:], start=settled + 1) if fit]
    assert later == [count for count in range(settled + 1, 41) if count % REFIT_EVERY == 0]


def test_the_typical_prompt_is_the_median_of_the_window() -> None:
    estimator = PrefillEstimator(FALLBACK, min_samples=4, window=4)
    assert estimator.typical_prompt() is None
    for cached, computed in [(0, 100), (900, 50), (0, 10), (300, 2000), (16, 400)]:
        estimator.record(cached, computed, 0.1)
    # the first point left the window: (900, 50), (0, 10), (300, 2000), (16, 400)
    assert estimator.typical_prompt() == (158, 225)
