"""The KV-event subscriber keeps pace: bursts past ZMQ's default high-water mark, live batches
during a slow replay, a replay that lost frames asked again from its first hole, and its lag,
against a local publisher speaking vLLM's wire format (ZMQ's default high-water marks on its
side, as vLLM keeps on its replay socket)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from specrag.cache import KVEvent
from specrag.pipeline.kv_mirror.subscriber import KVEventSubscriber
from specrag.pipeline.kv_mirror.target import MirrorTarget
from tests.helpers.kv_events import Publisher, hold_the_loop
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.timeout(90)


class Applied:
    """A mirror target counting the batches applied (and noting what degraded it)."""

    def __init__(self) -> None:
        self.batches = 0
        self.notes: list[str] = []

    def apply(self, events: Sequence[KVEvent]) -> None:
        self.batches += 1

    def target(self) -> MirrorTarget:
        return MirrorTarget(self.apply, lambda: None, self.notes.append, self.notes.append)


@asynccontextmanager
async def subscribed(publisher: Publisher) -> AsyncIterator[tuple[KVEventSubscriber, Applied]]:
    """A subscriber of ``publisher``, joined; stopped (and the publisher closed) at the end."""
    applied = Applied()
    subscriber = KVEventSubscriber(publisher.endpoint, publisher.replay_endpoint, "kv", applied.target())
    await subscriber.start()
    try:
        await wait_until(subscriber.joined.is_set, within_s=10)
        yield subscriber, applied
    finally:
        await subscriber.stop()
        await publisher.close()


async def all_applied(applied: Applied, batches: int) -> None:
    await wait_until(
        lambda: applied.batches >= batches, within_s=60, what=lambda: f"{applied.batches} applied"
    )
    assert applied.batches == batches


async def test_a_burst_past_zmqs_high_water_mark_while_the_loop_is_busy_loses_nothing(tmp_path: Path) -> None:
    """5,000 batches published at once (sending never yields to the loop), then the loop busy for
    a while: the subscriber must not leave them to ZMQ's queues of 1,000 messages."""
    burst = 5000
    publisher = Publisher(tmp_path)
    async with subscribed(publisher) as (subscriber, applied):
        for seq in range(burst):
            await publisher.publish(seq)
        hold_the_loop(1.0)
        await publisher.publish(burst)  # a later batch shows any hole
        await all_applied(applied, burst + 1)
        assert subscriber.sequence.lost == 0 and applied.notes == []


async def test_live_batches_flow_during_a_slow_replay_which_ends_where_they_begin(tmp_path: Path) -> None:
    """A hole of 300 batches replayed one frame every 10 ms (3 s: longer than any fixed total a
    replay could be given) while 3,000 live batches arrive at once: the live ones wait in the
    subscriber, not in ZMQ's queues, and the replay stops where they begin."""
    hole, live = 300, 3000
    publisher = Publisher(tmp_path, pace_s=0.01)
    async with subscribed(publisher) as (subscriber, applied):
        await publisher.publish(0)
        for seq in range(1, hole + 1):
            await publisher.publish(seq, drop=True)
        for seq in range(hole + 1, hole + 1 + live):
            await publisher.publish(seq)
        await all_applied(applied, hole + 1 + live)
        assert subscriber.sequence.lost == 0 and applied.notes == []
        assert subscriber.sequence.replayed == hole  # the live batches came live, not replayed


async def test_a_replay_that_lost_frames_is_asked_again_from_its_first_hole(tmp_path: Path) -> None:
    """The replay's answer misses batches 4 and 7 and its end marker (a ROUTER past its high-water
    mark drops them): it ends when nothing more comes, and the next one asks from batch 4."""
    publisher = Publisher(tmp_path, gaps=[frozenset(), frozenset({4, 7})])
    async with subscribed(publisher) as (subscriber, applied):
        await publisher.publish(0)
        for seq in range(1, 10):
            await publisher.publish(seq, drop=True)
        await publisher.publish(10)
        await all_applied(applied, 11)
        assert subscriber.sequence.lost == 0 and applied.notes == []
        assert publisher.starts == [0, 1, 4]


async def test_the_lag_counts_batches_received_and_not_yet_applied(tmp_path: Path) -> None:
    publisher = Publisher(tmp_path)
    async with subscribed(publisher) as (subscriber, applied):
        for seq in range(100):
            await publisher.publish(seq)
        hold_the_loop(1.0)  # received meanwhile, but the loop applies nothing
        behind = subscriber.lag()
        assert behind.batches == 100 and behind.seconds >= 0.5
        await all_applied(applied, 100)
        assert subscriber.lag().batches == 0 and subscriber.lag().seconds == 0.0
