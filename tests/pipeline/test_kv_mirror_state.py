"""The KV mirror's state: exact or degraded (and why), and its way back to exact."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

from specrag.cache import AllBlocksCleared, KnowledgeTree
from specrag.errors import EngineError
from specrag.pipeline.engines.config import KVEventSource
from specrag.pipeline.kv_mirror.mirror import WAITING_FOR_CLEAR, WAITING_FOR_JOIN, KVMirror
from tests.helpers.kv_events import Resets
from tests.helpers.tree import BLOCK, SYSTEM, FakeEngine, layout


def mirror(resets: Callable[[], Awaitable[None]] | None = None) -> KVMirror:
    tree = KnowledgeTree(SYSTEM, block_size=BLOCK)
    return KVMirror(tree, KVEventSource("ipc:///unused"), name="r1", reset_engine=resets)


def test_exact_from_the_publishers_first_batch_until_a_loss() -> None:
    kv = mirror()
    assert not kv.status.exact and kv.status.reason == WAITING_FOR_JOIN
    target = kv.target
    target.reset()  # the publisher's batch 0: the engine's cache was empty then
    target.apply(FakeEngine().serve(layout((1, 2))))
    assert kv.status.exact and kv.tree.system_prompt_resident()
    target.degrade("lost KV event batches 3..4")
    assert not kv.status.exact and kv.status.reason == "lost KV event batches 3..4"
    target.apply([AllBlocksCleared()])  # the engine emptied its cache: everything after is known
    assert kv.status.exact and not kv.tree.system_prompt_resident()


async def test_a_degraded_mirror_resets_the_idle_engine_and_is_exact_after_its_clear_event() -> None:
    resets = Resets()
    kv = mirror(resets)
    kv.target.reset()
    kv.target.apply(FakeEngine().serve(layout((1,))))
    assert not await kv.recover()  # exact: nothing to do
    kv.target.degrade("KV event batch 7 could not be applied")
    resets.busy = True
    assert not await kv.recover() and kv.status.reason == "KV event batch 7 could not be applied"
    resets.busy = False
    assert await kv.recover()
    assert kv.status.reason == WAITING_FOR_CLEAR and kv.status.recoveries == 1
    assert not kv.tree.system_prompt_resident()  # the tree forgot at once
    assert not await kv.recover() and resets.calls == 2  # no second reset while its event is due
    kv.target.apply([AllBlocksCleared()])
    assert kv.status.exact


async def test_a_clear_event_that_arrives_before_the_resets_reply_makes_the_mirror_exact() -> None:
    """vLLM publishes the reset's AllBlocksCleared with its next step: a query running meanwhile
    can bring it, and the blocks that query stores, before the reset's reply comes back."""

    async def reset_whose_event_overtakes_its_reply() -> None:
        assert kv.status.reason == WAITING_FOR_CLEAR  # waiting before asking
        assert not await kv.recover()  # a second recovery does not reset again meanwhile
        kv.target.apply([AllBlocksCleared(), *FakeEngine().serve(layout((1,)))])

    kv = mirror(reset_whose_event_overtakes_its_reply)
    kv.target.reset()
    kv.target.degrade("lost KV event batches 3..4")
    assert await kv.recover()
    assert kv.status.exact and kv.status.recoveries == 1
    assert kv.tree.system_prompt_resident()  # what was stored after the clear is kept


async def test_a_refused_reset_keeps_the_reason_and_one_that_came_meanwhile_wins() -> None:
    losses = iter(["", "KV event batch 9 could not be applied"])

    async def refused() -> None:
        loss_meanwhile = next(losses)
        if loss_meanwhile:
            kv.target.degrade(loss_meanwhile)
        raise EngineError("requests hold blocks")

    kv = mirror(refused)
    kv.target.reset()
    kv.target.degrade("lost KV event batches 3..4")
    assert not await kv.recover() and kv.status.reason == "lost KV event batches 3..4"
    assert not await kv.recover() and kv.status.reason == "KV event batch 9 could not be applied"


async def test_without_a_reset_the_mirror_stays_degraded() -> None:
    kv = mirror(None)
    kv.target.reset()
    kv.target.degrade("lost KV event batches 1..1")
    assert not await kv.recover() and not kv.status.exact


async def test_an_engine_restart_counts_as_a_sequence_reset(tmp_path: Path) -> None:
    """The supervisor's restart resubscribes from the new engine's batch 0: the new subscriber
    never sees the sequence go back, so the mirror itself counts the reset for /metrics."""
    tree = KnowledgeTree(SYSTEM, block_size=BLOCK)
    kv = KVMirror(tree, KVEventSource(f"ipc://{tmp_path / 'events'}", replay_endpoint=None), name="r1")
    await kv.start()
    try:
        kv.target.reset()
        assert kv.status.exact and kv.faults().sequence_resets == 0
        await kv.restart()
        assert kv.faults().sequence_resets == 1
        assert not kv.status.exact  # until the new engine's first batch
        kv.target.reset()
        assert kv.status.exact
        await kv.restart()
        assert kv.faults().sequence_resets == 2
    finally:
        await kv.stop()
    assert kv.faults().sequence_resets == 2  # kept once stopped
