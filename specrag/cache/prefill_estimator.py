"""The engine's prefill profile, fitted online from the requests it served.

PGDSF weighs a cached node by the prefill time it saves, so its costs must be those of the engine
in use, not of a machine a table was once measured on. Each served answer gives one point (cached
tokens, computed tokens, prefill seconds); once enough are in, a cold-prefill model
``seconds(n) = a·n + b·n²`` (per-token work plus attention, which grows with the context) is fitted
by least squares with ``a, b >= 0`` and an intercept for the per-request overhead (scheduling, the
first decode step), which cancels in a cost. Until then the given fallback profile stands.

A refit reads the whole window, so once the fit has settled it runs every
:data:`REFIT_EVERY`-th answer rather than after each: in front of a fast engine a refit per answer
was a visible share of the service's own CPU, and a few new points among hundreds barely move it.
"""

from __future__ import annotations

import numpy as np

from specrag.cache.pgdsf import PrefillProfile
from specrag.errors import InvalidInputError

__all__ = ["PrefillEstimator"]

_PROFILE_POINTS = 33
"""Points the fitted curve is sampled at over the observed prompt lengths (piecewise linear)."""

REFIT_EVERY = 8
"""Once ``2 × min_samples`` points are in, the profile is refitted after every this-many answers."""


class PrefillEstimator:
    """Records (cached, computed, seconds) of served requests and refits the prefill profile.

    ``window`` bounds the points kept (the newest), so the fit follows an engine that changes
    (a restart on other hardware) and costs bounded time per request.
    """

    def __init__(self, fallback: PrefillProfile, min_samples: int = 16, window: int = 512) -> None:
        if min_samples < 2 or window < min_samples:
            raise InvalidInputError("min_samples must be >= 2 and window >= min_samples")
        self.min_samples = min_samples
        # The newest ``window`` points as rows (cached, computed, seconds), written in a ring: a
        # refit after every answer reads them as an array without converting a list of tuples.
        self._ring = np.empty((window, 3), dtype=np.float64)
        self._count = 0  # points written so far; the next goes to row ``_count % window``
        self._profile = fallback
        # The fit's intercept: what a request costs the engine besides its tokens (0 until fitted).
        self.overhead_s = 0.0

    @property
    def profile(self) -> PrefillProfile:
        """The fitted profile once there is one, else the fallback."""
        return self._profile

    @property
    def samples(self) -> int:
        return min(self._count, len(self._ring))

    def typical_prompt(self) -> tuple[int, int] | None:
        """The median (cached, computed) tokens of the requests in the window; None before any.

        What a prompt of this service usually costs, for a decision taken before the prompt
        exists (whether a search's stages could pay for a speculation at all).
        """
        if self._count == 0:
            return None
        rows = self._ring[: self.samples]
        cached, computed = np.median(rows[:, 0]), np.median(rows[:, 1])
        return int(cached), int(computed)

    def record(self, cached: int, computed: int, seconds: float) -> PrefillProfile | None:
        """Add one served request; the refitted profile when this point was refitted at, else None.

        A request with nothing computed says nothing about prefill cost and is skipped.
        """
        if cached < 0 or computed < 0 or not np.isfinite(seconds) or seconds < 0:
            raise InvalidInputError(
                "a prefill sample needs tokens >= 0 and finite seconds >= 0, "
                f"got {cached}, {computed}, {seconds}"
            )
        if computed == 0:
            return None
        self._ring[self._count % len(self._ring)] = (cached, computed, seconds)
        self._count += 1
        settled = self._count >= 2 * self.min_samples
        if self._count < self.min_samples or (settled and self._count % REFIT_EVERY):
            return None
        fitted = self._fit()
        if fitted is not None:
            self._profile = fitted
        return fitted

    def _fit(self) -> PrefillProfile | None:
        """The non-negative (a, b) of least residual, as a profile; None if no cost is seen."""
        window = len(self._ring)
        if self._count <= window:
            data = self._ring[: self._count]
        else:  # oldest first, as the points came: the same rows in the same order fit the same
            start = self._count % window
            data = np.concatenate((self._ring[start:], self._ring[:start]))
        cached, computed, seconds = data[:, 0], data[:, 1], data[:, 2]
        # cost(c, m) = seconds(c + m) - seconds(c) = a·m + b·((c + m)² - c²)
        features = np.column_stack([computed, computed * (2 * cached + computed)])
        best: tuple[float, float, float, float] | None = None  # (residual, a, b, intercept)
        for used in ([0, 1], [0], [1]):  # the full model, else each term alone
            design = np.column_stack([np.ones(len(seconds)), features[:, used]])
            solution = np.linalg.lstsq(design, seconds, rcond=None)[0]
            coefficients = dict(zip(used, solution[1:].tolist(), strict=True))
            a, b = coefficients.get(0, 0.0), coefficients.get(1, 0.0)
            if a < 0 or b < 0 or a + b == 0:
                continue
            residual = float(np.sum((design @ solution - seconds) ** 2))
            if best is None or residual < best[0]:
                best = (residual, a, b, float(solution[0]))
        if best is None:
            return None
        _, a, b, intercept = best
        self.overhead_s = max(0.0, intercept)
        span = int((cached + computed).max())
        tokens = np.unique(np.linspace(0, span, _PROFILE_POINTS).astype(np.int64))
        points = [(int(n), a * n + b * n * n) for n in tokens.tolist()]
        return PrefillProfile(points, measured=True)
