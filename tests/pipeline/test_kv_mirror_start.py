"""The KV mirror at start, against a local publisher speaking vLLM's wire format: it joins and
replays before it claims exact, never empties a healthy engine's cache, and survives its
subscriber's death."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from specrag.cache import KnowledgeTree
from specrag.pipeline.engines.config import KVEventSource
from specrag.pipeline.kv_mirror.mirror import WAITING_FOR_JOIN, KVMirror
from tests.helpers.kv_events import Publisher, Resets
from tests.helpers.waiting import wait_until

pytestmark = pytest.mark.timeout(60)

TICK_S = 0.05  # the mirror's watch: a reset it would wrongly ask for comes within a few ticks


def source_of(tmp_path: Path) -> KVEventSource:
    """Where the test's :class:`Publisher` in ``tmp_path`` publishes (before it does)."""
    return KVEventSource(f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay")


def mirror_of(tmp_path: Path, resets: Resets, *, recovery_interval_s: float = TICK_S) -> KVMirror:
    # The publisher's batches store 4-token blocks under no system prompt the tests look at.
    tree = KnowledgeTree((1, 2, 3, 4), block_size=4)
    return KVMirror(
        tree, source_of(tmp_path), name="r1", reset_engine=resets, recovery_interval_s=recovery_interval_s
    )


@asynccontextmanager
async def beside_a_publisher(
    tmp_path: Path, *, recovery_interval_s: float = TICK_S
) -> AsyncIterator[tuple[Publisher, Resets, KVMirror]]:
    """A :class:`Publisher` in ``tmp_path``, the engine's resets and a mirror of the publisher (not
    started yet); the mirror is stopped and the publisher closed at the end."""
    publisher = Publisher(tmp_path)
    resets = Resets()
    kv = mirror_of(tmp_path, resets, recovery_interval_s=recovery_interval_s)
    try:
        yield publisher, resets, kv
    finally:
        await kv.stop()
        await publisher.close()


def resident(kv: KVMirror) -> set[object]:
    return {block_hash for _group, _medium, block_hash in kv.tree.resident_hashes()}


async def test_a_mirror_beside_a_warm_engine_replays_its_history_and_never_resets_it(tmp_path: Path) -> None:
    async with beside_a_publisher(tmp_path) as (publisher, resets, kv):
        for seq in range(4):  # served before specrag started: block 1 stored, then removed by batch 3
            await publisher.publish(seq)
        await kv.start()
        await asyncio.sleep(10 * TICK_S)
        assert resets.calls == 0
        assert kv.status.exact and resident(kv) == {0, 2}
        await publisher.publish(4)
        await wait_until(lambda: resident(kv) == {0, 2, 4}, what=lambda: f"{resident(kv)}")
        await kv.restart()  # a rejoin resubscribes: the replay again, no reset
        await wait_until(lambda: kv.status.exact and resident(kv) == {0, 2, 4}, what=lambda: f"{kv.status}")
        await asyncio.sleep(10 * TICK_S)
        assert resets.calls == 0


async def test_beside_a_fresh_engine_the_mirror_is_exact_once_joined(tmp_path: Path) -> None:
    """An engine that has published nothing has an empty cache: the empty replay proves the join."""
    async with beside_a_publisher(tmp_path) as (publisher, resets, kv):
        await kv.start()
        await asyncio.sleep(10 * TICK_S)
        assert resets.calls == 0
        assert kv.status.exact and publisher.replays == 1
        await publisher.publish(0)
        await wait_until(lambda: resident(kv) == {0})


async def test_a_history_no_longer_replayable_is_reported_and_only_a_later_loss_resets(
    tmp_path: Path,
) -> None:
    async with beside_a_publisher(tmp_path) as (publisher, resets, kv):
        for seq in (6, 7):  # the replay buffer no longer holds batches 0..5
            await publisher.publish(seq)
        await kv.start()
        await asyncio.sleep(10 * TICK_S)
        assert resets.calls == 0
        reason = kv.status.reason or ""
        assert not kv.status.exact and "batches 0..5" in reason and "no longer in its replay buffer" in reason
        await publisher.publish(8, drop=True)
        del publisher.sent[8]  # lost on the wire and not replayable: a real loss
        await publisher.publish(9)
        await wait_until(lambda: resets.calls > 0, what=lambda: f"{kv.status}")


async def test_without_catch_up_the_mirror_is_exact_only_once_the_subscription_joined(tmp_path: Path) -> None:
    """Started before the publisher is there, the SUB socket cannot have joined: a batch published
    now would pass it by, so the mirror must not say exact yet."""
    resets = Resets()
    kv = mirror_of(tmp_path, resets)
    kv.tree.engine_cache_cleared()
    publisher: Publisher | None = None
    try:
        await kv.start(catch_up=False)
        assert not kv.status.exact and kv.status.reason == WAITING_FOR_JOIN
        publisher = Publisher(tmp_path)
        assert source_of(tmp_path) == KVEventSource(publisher.endpoint, publisher.replay_endpoint)
        await wait_until(lambda: kv.status.exact, what=lambda: f"{kv.status}")
        await publisher.publish(0)
        await wait_until(lambda: resident(kv) == {0})
        assert resets.calls == 0
    finally:
        await kv.stop()
        if publisher is not None:
            await publisher.close()


async def test_a_dead_subscriber_degrades_the_mirror(tmp_path: Path) -> None:
    # recovery_interval_s: nothing subscribes again here
    async with beside_a_publisher(tmp_path, recovery_interval_s=3600) as (publisher, resets, kv):
        await kv.start()
        await publisher.publish(0)
        await wait_until(lambda: kv.status.exact and resident(kv) == {0})
        await publisher.pub.send_multipart((b"kv", b"not a batch"))  # a message the task cannot take
        await wait_until(lambda: not kv.status.exact)
        assert (kv.status.reason or "").startswith("the KV event subscriber stopped: ValueError")
        assert resets.calls == 0


async def test_a_dead_subscriber_is_replaced_and_replays_what_it_missed(tmp_path: Path) -> None:
    async with beside_a_publisher(tmp_path) as (publisher, resets, kv):
        await kv.start()
        await publisher.publish(0)
        await wait_until(lambda: resident(kv) == {0})
        await publisher.pub.send_multipart((b"kv", b"not a batch"))
        await publisher.publish(1)  # published while no task receives
        await wait_until(lambda: kv.status.exact and resident(kv) == {0, 1}, what=lambda: f"{kv.status}")
        await publisher.publish(2)
        await wait_until(lambda: resident(kv) == {0, 1, 2})
        assert resets.calls == 0 and kv.faults().lost_batches == 0
