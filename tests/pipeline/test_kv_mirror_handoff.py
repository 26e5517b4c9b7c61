"""The receiving thread's batches on the event loop: a bounded amount per loop turn, in order, and
a queue that keeps moving when what it runs fails."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from specrag.cache import BlockStored, KVEvent
from specrag.pipeline.kv_mirror.handoff import Handoff
from specrag.pipeline.kv_mirror.target import MirrorTarget
from tests.helpers.waiting import wait_until


def two_blocks(seq: int) -> list[KVEvent]:
    return [BlockStored((2 * seq, 2 * seq + 1), None, (0,) * 8, 4)]


class Final:
    """The mirror's side: what it applied and what it was told."""

    def __init__(self, *, failing_reset: bool = False) -> None:
        self.applied: list[Sequence[KVEvent]] = []
        self.notes: list[str] = []
        self.failing_reset = failing_reset

    def reset(self) -> None:
        if self.failing_reset:
            raise RuntimeError("the tree could not be emptied")
        self.notes.append("reset")

    def target(self) -> MirrorTarget:
        return MirrorTarget(self.applied.append, self.reset, self.notes.append, self.notes.append)


async def test_each_loop_turn_applies_a_bounded_number_of_block_events() -> None:
    final = Final()
    handoff = Handoff(final.target(), blocks_per_turn=4)
    handoff.bind(asyncio.get_running_loop())
    for seq in range(10):
        handoff.stamp(seq, 0.0)
        handoff.target.apply(two_blocks(seq))
    await asyncio.sleep(0)  # one loop turn
    assert len(final.applied) == 2  # 4 block events: two batches of two
    await wait_until(lambda: len(final.applied) == 10)
    assert final.applied == [two_blocks(seq) for seq in range(10)] and handoff.applied_position == 9


async def test_a_step_that_fails_on_the_loop_degrades_the_mirror_and_the_queue_moves_on() -> None:
    final = Final(failing_reset=True)
    handoff = Handoff(final.target(), blocks_per_turn=512)
    handoff.bind(asyncio.get_running_loop())
    handoff.target.reset()
    handoff.stamp(0, 0.0)
    handoff.target.apply(two_blocks(0))
    await wait_until(lambda: len(final.applied) == 1)
    assert final.notes == ["the KV mirror could not take an event it was handed"]
