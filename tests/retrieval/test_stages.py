"""How the stage schedules cut a search's work (the driver alone, without an index)."""

from __future__ import annotations

import numpy as np
import pytest

from specrag.retrieval.search.stages import StagePlan, run_stages


def cumulative_units(plan: StagePlan, expected_units: int) -> list[int]:
    """The work done by the end of each stage of a search of exactly ``expected_units`` units."""
    done: list[int] = [0]

    def advance(units: int) -> bool:
        done[0] = min(expected_units, done[0] + units)
        return done[0] == expected_units

    def snapshot() -> tuple[np.ndarray, np.ndarray]:
        return np.zeros(1, dtype=np.float32), np.array([done[0]])

    return [int(stage.ids[0]) for stage in run_stages(advance, snapshot, plan, expected_units)]


@pytest.mark.parametrize(
    ("plan", "expected"),
    [
        (StagePlan(4, "equal"), [64, 128, 192, 256]),
        (StagePlan(4, schedule="geometric"), [32, 64, 128, 256]),
        (StagePlan(2, schedule="geometric"), [128, 256]),
        (StagePlan(1, schedule="geometric"), [256]),
    ],
)
def test_schedules_cut_the_work_as_documented(plan: StagePlan, expected: list[int]) -> None:
    assert cumulative_units(plan, 256) == expected


def test_geometric_stages_with_little_work_still_advance_and_finish() -> None:
    # 1/128 of 3 units floors to 0: every stage must still do at least one unit, and the last all.
    assert cumulative_units(StagePlan(8, schedule="geometric"), 3) == [1, 2, 3]


def test_a_plan_is_resolved_in_one_place_with_each_kinds_defaults() -> None:
    """Unset settings take the index kind's count and the schedule that measured best; set ones
    win; a kind with no default needs a count."""
    from specrag.errors import InvalidInputError
    from specrag.retrieval.search.stages import DEFAULT_SCHEDULE, DEFAULT_STAGES, stage_plan

    assert DEFAULT_SCHEDULE == "geometric"
    assert stage_plan("ivf") == StagePlan(DEFAULT_STAGES["ivf"], "geometric")
    assert stage_plan("hnsw") == StagePlan(DEFAULT_STAGES["hnsw"], "geometric")
    assert stage_plan("ivf", 3, "equal") == StagePlan(3, "equal")
    assert stage_plan("other", default_stages=2) == StagePlan(2, "geometric")
    with pytest.raises(InvalidInputError, match="no default stage count"):
        stage_plan("other")
    with pytest.raises(InvalidInputError, match="unknown stage schedule"):
        stage_plan("ivf", schedule="front")
