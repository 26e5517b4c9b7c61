"""bench.capacity.mirror_rate's figures: which rates count as kept, and the engine steps it publishes."""

from __future__ import annotations

from typing import Any

from bench.capacity.mirror_rate import BLOCKS_PER_STEP, CACHE_BLOCKS, EngineSteps, summarize


def row(rate: float, *, lost: int = 0, applied: bool = True, lag_s: float = 0.01) -> dict[str, Any]:
    return {
        "block_events_per_s": rate,
        "lost_batches": lost,
        "all_applied": applied,
        "exact_at_end": True,
        "lag_seconds_p99": lag_s,
    }


def test_a_rate_counts_without_loss_only_if_all_was_applied_and_kept_pace_only_if_never_far_behind() -> None:
    baseline = {"rate_target": 0}
    rows = [baseline, row(10_000), row(50_000), row(75_000, lag_s=12.0), row(90_000, applied=False)]
    result = summarize([*rows, row(20_000, lost=3)], quick=False, seconds=60.0)
    assert result["mirror_events_per_s_no_loss"] == 75_000
    assert result["mirror_events_per_s_kept_pace"] == 50_000
    assert result["mirror_lost_batches"] == 3 and result["target_met"]
    assert not summarize(rows, quick=True, seconds=10.0)["target_met"]  # too short to check it


def test_the_steps_store_blocks_and_once_the_cache_is_full_evict_as_many_stored_earlier() -> None:
    steps = EngineSteps()
    stored: set[int] = set()
    counts = []
    for _ in range(CACHE_BLOCKS // BLOCKS_PER_STEP + 10):
        count, events = steps.step()
        counts.append(count)
        stored.update(events[0].block_hashes)
        for event in events[1:]:
            assert set(event.block_hashes) <= stored
            stored.difference_update(event.block_hashes)
    assert counts[0] == BLOCKS_PER_STEP and counts[-1] == 2 * BLOCKS_PER_STEP
    assert len(stored) == CACHE_BLOCKS
