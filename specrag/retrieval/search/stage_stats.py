"""What a staged search's stages have been worth: learned online, per index setting and stage.

A speculative prefill on a stage's running top-k pays only when that top-k is the final one and
enough search is still to come to hide the prefill behind. Neither can be known for the query at
hand, but both repeat from query to query on the same index and plan, so every finished staged
search teaches them: how often each stage's top-k already was the final one (as a set, and in
order), and how much search time (the stages' own compute time, measured where the search runs)
followed it. The controller's speculation policy
(:mod:`specrag.controller.speculation_policy`) prices speculations from these figures.

Statistics are kept per :class:`PlanKey`: the searcher's settings (an IVF's ``nprobe``, an HNSW's
``efSearch``), k and the stage plan, since each changes both figures. They live with the index,
not with a controller: what the index taught outlives a controller rebuilt around it. One owner
records and is read: the index's staged search (``VectorIndex.search_staged``, whose
``StagedSearch`` records a finished search and answers ``outlook`` for the one in progress), so the
key is made once, from the plan the controller resolved, and nobody else writes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from specrag.retrieval.search.stages import Schedule, StagePlan, StageResult

__all__ = ["WINDOW", "PlanKey", "StageOutlook", "StageStatistics"]

WINDOW = 256
"""Observations a figure weighs at most: older ones fade, so the figures follow a changing load."""


@dataclass(frozen=True)
class PlanKey:
    """What a stage's figures depend on: the searcher's settings, k and how stages are cut."""

    settings: tuple[tuple[str, str], ...]
    k: int
    num_stages: int
    schedule: Schedule | str


@dataclass(frozen=True)
class StageOutlook:
    """What is expected after a stage: the chance its top-k is final, and the search left.

    ``p_final_set`` counts a top-k with the final documents in any order (a prompt whose
    documents are ordered by the knowledge tree), ``p_final_list`` one in the final order (a prompt
    in retrieval order). ``observed`` is how many searches taught the figures (0: prior only).
    ``later``: the same figures for the stages still to come before the last one, each a chance
    to speculate instead of this one (only stages some search has reached; their own ``later`` is
    empty).
    """

    p_final_set: float
    p_final_list: float
    remaining_s: float
    observed: int
    later: tuple[StageOutlook, ...] = ()


class _StageRecord:
    """Running figures of one stage; counts fade once past :data:`WINDOW`."""

    __slots__ = ("final_list", "final_set", "remaining_s", "seen")

    def __init__(self) -> None:
        self.seen = 0.0
        self.final_set = 0.0
        self.final_list = 0.0
        self.remaining_s = 0.0

    def add(self, final_set: bool, final_list: bool, remaining_s: float) -> None:
        if self.seen >= WINDOW:
            fade = (WINDOW - 1) / WINDOW
            self.seen *= fade
            self.final_set *= fade
            self.final_list *= fade
        self.seen += 1
        self.final_set += final_set
        self.final_list += final_list
        self.remaining_s += (remaining_s - self.remaining_s) / self.seen


class StageStatistics:
    """Per plan and stage: how often the stage's top-k was final, and the search time after it.

    Stage 0 stands for the search's start (its remaining time is the whole search), which is
    what a warm-up started beside the search can hide behind. Thread-safe: searches of several
    queries may finish at once on a pool of search threads.
    """

    def __init__(self) -> None:
        self._records: dict[tuple[PlanKey, int], _StageRecord] = {}
        self._lock = threading.Lock()

    def record(self, key: PlanKey, stages: Sequence[StageResult]) -> None:
        """Learn from one finished single-query search (its stages, the last one done)."""
        if not stages or not stages[-1].done:
            return
        final = stages[-1].ids
        final_list = tuple(int(i) for i in final if i >= 0)
        final_set = frozenset(final_list)
        elapsed = np.array([stage.elapsed_s for stage in stages], dtype=np.float64)
        after = np.cumsum(elapsed[::-1])[::-1]  # after[i]: stages i.. to the end
        with self._lock:
            self._stage(key, 0).add(True, True, float(after[0]))  # no top-k yet: none to go stale
            for position, stage in enumerate(stages[:-1]):
                ids = tuple(int(i) for i in stage.ids if i >= 0)
                self._stage(key, stage.stage).add(
                    frozenset(ids) == final_set, ids == final_list, float(after[position + 1])
                )

    def outlook(self, key: PlanKey, stage: int, elapsed_s: float) -> StageOutlook:
        """The expected figures after ``stage`` of a search that has run ``elapsed_s`` so far.

        Before any search taught them: the chance is 1/2 (no evidence either way), and the search
        left is extrapolated from this search's own pace through the plan's share of the work
        done (:meth:`StagePlan.done_fraction`); at stage 0 nothing can be, so none is assumed.
        """
        with self._lock:
            later = tuple(self._learned(key, stage + 1))
            record = self._records.get((key, stage))
            if record is not None and record.seen:
                return self._figures(record, later)
        done = StagePlan(key.num_stages, schedule=key.schedule).done_fraction(stage) if stage else 1.0
        return StageOutlook(0.5, 0.5, max(0.0, elapsed_s) * (1 - done) / done, 0, later)

    def _learned(self, key: PlanKey, first: int) -> Iterator[StageOutlook]:
        """The learned figures of stages ``first``, ``first + 1``, ... up to the first stage no
        search has reached (a stage that was always the last is never recorded)."""
        number = first
        while (record := self._records.get((key, number))) is not None and record.seen:
            yield self._figures(record, ())
            number += 1

    @staticmethod
    def _figures(record: _StageRecord, later: tuple[StageOutlook, ...]) -> StageOutlook:
        """A record's figures, its chances smoothed by one success and one failure (Laplace)."""
        return StageOutlook(
            (record.final_set + 1) / (record.seen + 2),
            (record.final_list + 1) / (record.seen + 2),
            record.remaining_s,
            round(record.seen),
            later,
        )

    def _stage(self, key: PlanKey, stage: int) -> _StageRecord:
        record = self._records.get((key, stage))
        if record is None:
            record = self._records[(key, stage)] = _StageRecord()
        return record
