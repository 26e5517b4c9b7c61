"""Stage results and the stage scheduler shared by every staged index.

The controller speculates on the running top-k of an unfinished search (RAGCache §5.3), so a
staged search is a sequence of :class:`StageResult` snapshots whose last one is, by contract, the
result the same index gives in one shot. How the work is cut into stages — by a fixed count of
equal slices, by geometrically growing ones, or by a time budget per stage — is independent of
the index kind, so it lives here: an index only says how to do ``n`` more units of work (IVF:
probe lists, HNSW: node expansions).
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from specrag.errors import InvalidInputError, check_choice

__all__ = [
    "DEFAULT_SCHEDULE",
    "DEFAULT_STAGES",
    "UNBOUNDED",
    "Capabilities",
    "FaissBacked",
    "Schedule",
    "StageCursor",
    "StagePlan",
    "StageResult",
    "StagedSearcher",
    "prepare_queries",
    "run_stages",
    "stage_plan",
]

# Work beyond this is "everything that is left": a unit count no search reaches.
UNBOUNDED = 1 << 62


# How count-based stages cut the expected work: "equal" slices (1/S, 2/S, ... of it), or
# "geometric" ones that double (1/2^(S-1), ..., 1/4, 1/2, 1): a small first stage lets a
# speculative prefill start after a fraction of the search, since the nearest probe lists (the
# closest graph nodes) already hold most of the final top-k, at the same total work.
class Schedule(enum.StrEnum):
    """How count-based stages cut the expected work (above)."""

    EQUAL = "equal"
    GEOMETRIC = "geometric"


# The schedule that measured best (bench/retrieval/search.py: the running top-k final earliest
# within docs/retrieval.md's bound on the cost of staging): geometric stages, so that the first
# speculation starts after a small share of the search. How many (how small the first) depends on
# the index kind, below.
DEFAULT_SCHEDULE = Schedule.GEOMETRIC
# How many stages a search of each index kind is cut into unless told otherwise (stage_plan).
# Geometric stages start with 1/2^(S-1) of the work, so S sets how early the first speculation
# starts:
# - IVF, 6 (first stage 1/32 of the probe list): its nearest lists hold the final top-k about as
#   often after 1/32 as after 1/16, and the speculation starts earlier;
# - HNSW, 5 (1/16 of the expected node expansions): a graph search reaches the query's
#   neighbourhood later, so a smaller first stage is final much less often, and a stale
#   speculation costs the engine the step it is in.
# bench.retrieval.search names these two as each kind's best schedule; its figures are in
# docs/retrieval.md, "Stage schedules".
DEFAULT_STAGES = {"ivf": 6, "hnsw": 5}


@dataclass(frozen=True)
class StageResult:
    """The running top-k after one stage.

    ``ids`` are index rows (``-1`` marks padding when fewer than k rows exist or were reached);
    ``distances`` are faiss's values for the metric (inner products, descending, for the unit
    vectors the embedders produce). Batch searches hold one row per query, single-query searches
    hold 1-D arrays. ``stage`` counts from 1; ``done`` is true on the final stage only, whose
    result equals a one-shot search. ``elapsed_s`` is the compute time of this stage alone.
    """

    stage: int
    ids: np.ndarray
    distances: np.ndarray
    done: bool
    elapsed_s: float

    def for_query(self, row: int) -> StageResult:
        """The 1-D result of one query of a batch."""
        return StageResult(self.stage, self.ids[row], self.distances[row], self.done, self.elapsed_s)


@dataclass(frozen=True)
class StagePlan:
    """How to cut a search into stages: ``num_stages`` slices cut by ``schedule``, or
    ``stage_budget_s`` each (:meth:`budget`).

    With a time budget the number of stages is whatever the search needs (the schedule is not
    used). With a count, a search with fewer work units than stages (an IVF ``nprobe`` below the
    count, an HNSW search that converges early) ends in fewer stages; the last stage always
    finishes the search, so every schedule ends on the one-shot result. No field has a default:
    a plan for an index comes from :func:`stage_plan` (through ``VectorIndex.stage_plan``), the
    one place the defaults of each index kind are applied.
    """

    num_stages: int
    schedule: Schedule | str
    stage_budget_s: float | None = None

    @classmethod
    def budget(cls, stage_budget_s: float) -> StagePlan:
        """Stages of ``stage_budget_s`` each, as many as the search needs."""
        return cls(1, Schedule.EQUAL, stage_budget_s)

    def __post_init__(self) -> None:
        if self.num_stages < 1:
            raise InvalidInputError(f"num_stages must be at least 1, got {self.num_stages}")
        if self.stage_budget_s is not None and not self.stage_budget_s > 0:
            raise InvalidInputError(f"stage_budget_s must be positive, got {self.stage_budget_s}")
        object.__setattr__(self, "schedule", check_choice("stage schedule", self.schedule, Schedule))

    def done_fraction(self, stage: int) -> float:
        """The share of the expected work done by the end of count-based ``stage`` (from 1)."""
        if stage >= self.num_stages:
            return 1.0
        if self.schedule is Schedule.GEOMETRIC:
            return float(2.0 ** (stage - self.num_stages))
        return stage / self.num_stages


def stage_plan(
    kind: str,
    num_stages: int | None = None,
    schedule: Schedule | str | None = None,
    default_stages: int | None = None,
) -> StagePlan:
    """The plan of a search of an index of ``kind``: ``num_stages`` (else ``default_stages``, else
    the kind's :data:`DEFAULT_STAGES`) cut by ``schedule`` (else :data:`DEFAULT_SCHEDULE`).

    The one place a search's stage settings are resolved: the service, the benchmarks and a
    script that searches a ``VectorIndex`` directly all get the schedule that measured best.
    """
    count = num_stages if num_stages is not None else default_stages or DEFAULT_STAGES.get(kind)
    if count is None:
        raise InvalidInputError(f"no default stage count for index kind {kind!r}: give num_stages")
    return StagePlan(count, schedule if schedule is not None else DEFAULT_SCHEDULE)


def prepare_queries(queries: np.ndarray, dim: int, ntotal: int, k: int) -> np.ndarray:
    """Validate a query batch (or one query) and return it as a C-contiguous float32 matrix."""
    if ntotal == 0:
        raise InvalidInputError("the index is empty: build it from a non-empty corpus")
    if k < 1:
        raise InvalidInputError(f"k must be at least 1, got {k}")
    matrix = np.asarray(queries, dtype=np.float32)
    if matrix.ndim == 1:
        matrix = matrix[None, :]
    if matrix.ndim != 2 or matrix.shape[1] != dim or matrix.shape[0] == 0:
        raise InvalidInputError(
            f"expected queries of dimension {dim}, got an array of shape {np.shape(queries)}"
        )
    if not np.isfinite(matrix).all():
        raise InvalidInputError("queries contain NaN or infinite values")
    return np.ascontiguousarray(matrix)


def run_stages(
    advance: Callable[[int], bool],
    snapshot: Callable[[], tuple[np.ndarray, np.ndarray]],
    plan: StagePlan,
    expected_units: int,
    started: float | None = None,
) -> Iterator[StageResult]:
    """Drive a resumable search through the stages of ``plan``.

    ``advance(n)`` does at most ``n`` more units of work and returns True once the search is
    complete; ``snapshot()`` returns the sorted running (distances, ids). ``expected_units`` is the
    work a whole search takes (exact for IVF, an average for HNSW) and sizes count-based stages.
    ``started`` lets the caller charge set-up work (the coarse quantizer) to the first stage.
    """
    stage_start = time.perf_counter() if started is None else started
    stage = 0
    units_done = 0
    units_per_second: float | None = None
    done = False
    while not done:
        stage += 1
        if plan.stage_budget_s is None:
            if stage >= plan.num_stages:
                target = UNBOUNDED
            else:
                target = max(units_done + 1, math.floor(expected_units * plan.done_fraction(stage)))
            done = advance(target - units_done)
            units_done = target
        else:
            deadline = stage_start + plan.stage_budget_s
            left = plan.stage_budget_s
            # At least one call per stage, so a budget below the fixed cost still makes progress.
            while not done and (left > 0 or units_per_second is None):
                # Probe the speed with one unit, then size each call to fill the rest of the budget.
                units = 1 if units_per_second is None else max(1, int(units_per_second * left))
                call_start = time.perf_counter()
                done = advance(units)
                units_per_second = units / max(time.perf_counter() - call_start, 1e-9)
                left = deadline - time.perf_counter()
        distances, ids = snapshot()
        now = time.perf_counter()
        yield StageResult(stage=stage, ids=ids, distances=distances, done=done, elapsed_s=now - stage_start)
        stage_start = time.perf_counter()


class FaissBacked:
    """Shape of a searcher backed by a faiss index in ``self.index``."""

    index: Any

    @property
    def dim(self) -> int:
        return int(self.index.d)

    @property
    def ntotal(self) -> int:
        return int(self.index.ntotal)

    def vectors_to_add(self, vectors: np.ndarray) -> np.ndarray:
        """``vectors`` as the C-contiguous float32 matrix faiss adds, or InvalidInputError when
        they are not a matrix of this index's dimension."""
        matrix = np.ascontiguousarray(vectors, dtype=np.float32)
        if matrix.ndim != 2 or matrix.shape[1] != self.dim:
            raise InvalidInputError(f"expected vectors of dimension {self.dim}, got shape {matrix.shape}")
        return matrix


class StageCursor(Protocol):
    """One staged search in progress: what :func:`run_stages` drives, and what a sharded index
    drives in every shard in lock step (the same units per stage in each)."""

    def advance(self, units: int) -> bool:
        """Do at most ``units`` more units of work; True once the search is complete."""
        ...

    def snapshot(self) -> tuple[np.ndarray, np.ndarray]:
        """The sorted running (distances, ids), best first."""
        ...


@dataclass(frozen=True)
class Capabilities:
    """What a staged searcher can do beyond searching in one shot and in stages, declared by the
    searcher and checked once, when an index opens it (the index never asks which class it holds).

    ``live_rows``: it takes rows while it serves, returns only the rows a search's visibility shows,
    and drops hidden ones when compacted (``live_index.Growable``); ``retrains``: its centroids can be
    trained anew on the rows kept (``live_index.Retrainable``); ``ranks_text``: it ranks query texts
    itself, in the same read of its rows as its stages (a database's full-text search); ``snapshot_rows``:
    it takes every search's visibility, rows hidden or not, since its snapshot may hold versions the
    visibility does not show yet (a database's); ``partial_answers``: its parts may fail one by one
    and it can answer without them, saying which answered (a sharded index's ``ShardAnswers``).
    """

    live_rows: bool = False
    retrains: bool = False
    ranks_text: bool = False
    snapshot_rows: bool = False
    partial_answers: bool = False


class StagedSearcher(Protocol):
    """What every staged index offers; rows are positional ids (row i = the i-th vector added)."""

    kind: str
    owner: Any  # the faiss index object to save (it owns the memory the searcher reads)
    capabilities: Capabilities

    @property
    def dim(self) -> int: ...

    @property
    def ntotal(self) -> int: ...

    @property
    def settings(self) -> dict[str, Any]: ...

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]: ...

    def stages(self, queries: np.ndarray, k: int, plan: StagePlan) -> Iterator[StageResult]: ...
