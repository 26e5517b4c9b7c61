"""Whether a speculative prefill is worth launching now: its expected gain against its expected
cost, and against waiting for a later stage.

A speculation on a stage's running top-k saves, when that top-k turns out final, the part of the
prompt's prefill that the rest of the search hides: ``min(search left, prefill)``. When it turns
out stale it saves nothing and costs engine time: the prefill of its uncached tokens (plus the
fixed cost of a request) delays every request that waits for the engine behind it, and this
query's own final request too when the prefill outlasts the search left. So, with ``p`` the
chance the stage's top-k is final::

    gain = p · min(search left, prefill)
    cost = (1 − p) · (hold · waiting + max(0, hold − search left)),  hold = overhead + prefill

A stale speculation also holds up this query's next one. The engine takes an abort and a new
request only between its steps, so the speculation launched when a later stage replaces the top-k
waits for the step in progress (at most ``step``, the overhead plus the prefill of one step's
tokens, and never past the stale prefill's end). That replacement is final with chance
``p_later − p`` beside this one's being stale (a top-k final at one stage stays final), and it
still hides the search left at its stage less that wait, which ``gain`` adds. Against all this
stands launching nothing now and speculating at the best later stage instead (its own ``gain −
cost`` with the search left there, ``later``). The speculation is launched only when
``gain > cost`` and ``gain − cost ≥ later`` (then still only through the prefill gate, whose
capacity and speculation budget hold under load). An early stage whose top-k is often replaced a
moment later thus waits for that moment, instead of holding the engine a whole step on a guess.

Every figure is measured while the system runs, none is a table: ``p``, ``p_later`` and the search
left are learned per index setting and stage from finished searches
(:class:`~specrag.retrieval.search.stage_stats.StageStatistics`), the prefill from the engine profile
PGDSF fits (:class:`~specrag.cache.prefill_estimator.PrefillEstimator`, whose intercept is the
per-request overhead), ``waiting`` from the engine's load and the gate, the step's tokens from the
engine's per-step token budget.

Where search is short against the prefill (r ≪ 1) the gain is at most the little search left
while a stale prompt holds the engine for its whole prefill, so only a near-certain top-k is
speculated on; where search is long (r ≥ 1) and the engine idle, a stale speculation finishes
before the search does and costs nothing, so every stage is speculated on, as before; under load
a stage whose top-k is unlikely final is held back until a later stage, whose top-k is likelier.

The system-prompt warm-up is priced the same way: the system prompt begins every final prompt,
so its prefill is never stale (``p = 1``) and saves ``min(search left, its prefill)``; what it
costs is one more request's fixed overhead, for this query's final request and every waiting one.

Stages cost something themselves: each stage's top-k is handed to the query, ordered and built
into a prompt only to be priced, and a staged search does more work than one search. So before a
search starts, each stage the index has learned is priced the same way with a typical recent
prompt in place of its own (which does not exist yet); when none is expected to gain more than it
costs, the search runs in one stage (:meth:`SpeculationPolicy.unstaged`). In front of GPU replicas,
whose prefill takes tens of milliseconds against a few of search, that is nearly every search. One
in :data:`EXPLORE_EVERY` of them still runs in stages, so that the stages' figures go on being
learned and a change (a slower engine, a larger index) is seen.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

from specrag.cache.prefill_estimator import PrefillEstimator
from specrag.retrieval.search.stage_stats import StageOutlook

__all__ = [
    "EXPLORE_EVERY",
    "LEARNED_FROM",
    "NO_SPECULATION",
    "Price",
    "QuerySpeculation",
    "SpeculationPolicy",
    "SpeculationSetting",
]

LEARNED_FROM = 8
"""Searches every stage must have been learned from before a search may run in one stage."""

EXPLORE_EVERY = 16
"""Of the searches that would run in one stage, every this-many-th runs in stages anyway."""


class SpeculationSetting(enum.StrEnum):
    """Whether a mode that speculates asks the policy first."""

    AUTO = "auto"
    """Each speculation (and warm-up) launched only when its price says it pays."""
    ALWAYS = "always"
    """On every stage that changed the top-k, while the gate has room (the behaviour before the
    policy, for experiments)."""
    NEVER = "never"
    """No speculative prefill on a running top-k."""


@dataclass(frozen=True)
class Price:
    """One priced speculation or warm-up: expected seconds saved and lost over all requests."""

    gain_s: float
    cost_s: float
    p_final: float
    remaining_s: float
    prefill_s: float
    waiting: int
    observed: int  # searches the figures were learned from (0: the prior)
    later_s: float = 0.0  # gain − cost of speculating at the best later stage instead (0: none)

    @property
    def pays(self) -> bool:
        """Worth launching now: it gains more than it costs, and no later stage is expected to."""
        return self.gain_s > self.cost_s and self.gain_s - self.cost_s >= self.later_s

    @property
    def deferred(self) -> bool:
        """It would pay, but a later stage is expected to pay more: wait for it."""
        return self.gain_s > self.cost_s and not self.pays

    def detail(self) -> dict[str, float | int]:
        """The figures a timeline event shows, so a reader sees why it did or did not launch."""
        return {
            "gain_ms": round(self.gain_s * 1000, 3),
            "cost_ms": round(self.cost_s * 1000, 3),
            "p_final": round(self.p_final, 3),
            "remaining_ms": round(self.remaining_s * 1000, 3),
            "prefill_ms": round(self.prefill_s * 1000, 3),
            "waiting": self.waiting,
            "observed": self.observed,
            "later_ms": round(self.later_s * 1000, 3),
        }


@dataclass(frozen=True)
class QuerySpeculation:
    """The policy's answer for one query, given once when the query is checked: whether it
    speculates on running top-ks, and the price each of its launches waits for.

    The run asks this object and never the setting, so the setting is read in one place
    (:meth:`SpeculationPolicy.for_query`). A price of None means "not priced": launch whenever
    the gate has room (``always``, and warm-ups under ``never``).
    """

    speculates: bool
    pricing: SpeculationPolicy | None = None  # None: launches wait for no price

    def speculation(
        self, outlook: StageOutlook, ordered: bool, cached_tokens: int, computed_tokens: int, waiting: int
    ) -> Price | None:
        """The price of speculating on a stage's prompt (:meth:`SpeculationPolicy.speculation`)."""
        if self.pricing is None:
            return None
        return self.pricing.speculation(outlook, ordered, cached_tokens, computed_tokens, waiting)

    def warmup(self, outlook: StageOutlook, system_tokens: int, waiting: int) -> Price | None:
        """The price of warming the system prompt now (:meth:`SpeculationPolicy.warmup`)."""
        return None if self.pricing is None else self.pricing.warmup(outlook, system_tokens, waiting)

    def unstaged(self, start: StageOutlook, ordered: bool, waiting: int) -> Price | None:
        """Whether a search about to start runs in one stage (:meth:`SpeculationPolicy.unstaged`);
        a query whose launches are not priced always runs its stages."""
        return None if self.pricing is None else self.pricing.unstaged(start, ordered, waiting)


NO_SPECULATION = QuerySpeculation(speculates=False)
"""A query that speculates on nothing and prices nothing (a request not yet checked)."""


class SpeculationPolicy:
    """Prices speculations and warm-ups from measured figures; ``setting`` says, through
    :meth:`for_query`, which queries speculate and whether their launches are priced."""

    def __init__(self, setting: SpeculationSetting, estimator: PrefillEstimator, step_tokens: int) -> None:
        self.setting = setting
        self._estimator = estimator
        self._step_tokens = step_tokens  # prompt tokens the engine computes in one step, at most
        self._unstaged = 0  # searches found not worth their stages so far (every few run them anyway)

    def for_query(self, mode_speculates: bool) -> QuerySpeculation:
        """The answer for a query whose mode speculates (``mode_speculates``) or not: it
        speculates unless the setting is ``never``; its launches (and warm-ups) are priced only
        under ``auto``."""
        pricing = self if self.setting is SpeculationSetting.AUTO else None
        return QuerySpeculation(mode_speculates and self.setting is not SpeculationSetting.NEVER, pricing)

    def speculation(
        self, outlook: StageOutlook, ordered: bool, cached_tokens: int, computed_tokens: int, waiting: int
    ) -> Price:
        """The price of speculating on a stage's top-k with this prompt.

        ``ordered``: the prompt's documents are ordered by the knowledge tree, so a top-k with the
        final documents in another order still makes the final prompt. ``waiting``: requests that
        wait for the engine now (the speculation would hold each of them up if it turns stale).
        """
        p = _chance(outlook, ordered)
        cost_of = self._estimator.profile.cost
        prefill = cost_of(cached_tokens, computed_tokens)
        hold = self._estimator.overhead_s + prefill
        step = self._estimator.overhead_s + cost_of(cached_tokens, min(computed_tokens, self._step_tokens))
        left = outlook.remaining_s
        rescue = 0.0  # what a later stage's replacement still hides once this one turned stale
        later = 0.0  # what speculating at the best later stage instead is worth
        for figures in outlook.later:
            p_later, left_later = _chance(figures, ordered), figures.remaining_s
            wait = min(step, max(0.0, hold - (left - left_later)))  # the stale step in progress
            hidden = min(max(0.0, left_later - wait), prefill)
            rescue = max(rescue, max(0.0, p_later - p) * hidden)
            later = max(later, _net(p_later, left_later, prefill, hold, waiting))
        gain = p * min(left, prefill) + rescue
        cost = (1 - p) * _stale_cost(left, hold, waiting)
        return Price(gain, cost, p, left, prefill, waiting, outlook.observed, later)

    def unstaged(self, start: StageOutlook, ordered: bool, waiting: int) -> Price | None:
        """The best price a stage of the search about to start is expected to have, when even it
        gains no more than it costs: the search then runs in one stage. None: run the stages (one
        may pay; a stage was learned from fewer than :data:`LEARNED_FROM` searches; no answer has
        been served yet; or this is the one in :data:`EXPLORE_EVERY` kept staged).

        ``start``: the search's outlook at its start, whose ``later`` are the learned stages. Each
        is priced as :meth:`speculation` prices it, the stages after it as its later chances, with
        the median recent prompt (:meth:`PrefillEstimator.typical_prompt`) as its prompt.
        """
        typical = self._estimator.typical_prompt()
        stages = start.later
        if typical is None or not stages or min(stage.observed for stage in stages) < LEARNED_FROM:
            return None
        prices = [
            self.speculation(replace(stage, later=stages[number + 1 :]), ordered, *typical, waiting)
            for number, stage in enumerate(stages)
        ]
        best = max(prices, key=lambda price: price.gain_s - price.cost_s)
        if best.gain_s > best.cost_s:
            return None
        self._unstaged += 1
        return None if self._unstaged % EXPLORE_EVERY == 0 else best

    def warmup(self, outlook: StageOutlook, system_tokens: int, waiting: int) -> Price:
        """The price of prefilling the cold system prompt now, beside the search left."""
        prefill = self._estimator.profile.cost(0, system_tokens)
        gain = min(outlook.remaining_s, prefill)
        cost = self._estimator.overhead_s * (waiting + 1)
        return Price(gain, cost, 1.0, outlook.remaining_s, prefill, waiting, outlook.observed)


def _chance(outlook: StageOutlook, ordered: bool) -> float:
    """The chance a stage's top-k makes the final prompt: as a set when the tree orders it."""
    return outlook.p_final_set if ordered else outlook.p_final_list


def _stale_cost(left: float, hold: float, waiting: int) -> float:
    """What a stale speculation costs: its hold on every waiting request, and on this query's final
    request when it outlasts the search left."""
    return hold * waiting + max(0.0, hold - left)


def _net(p: float, left: float, prefill: float, hold: float, waiting: int) -> float:
    """A speculation's expected gain less its expected cost, at a stage with ``left`` to go."""
    return p * min(left, prefill) - (1 - p) * _stale_cost(left, hold, waiting)
