"""The KV-event subscriber against a local publisher speaking vLLM's wire format."""

import asyncio
import logging
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import zmq
from vllm.distributed import kv_events as vllm_events

from specrag.cache import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from specrag.pipeline.kv_mirror.sequence import EventSequence, convert_event
from specrag.pipeline.kv_mirror.subscriber import KVEventSubscriber
from specrag.pipeline.kv_mirror.target import MirrorTarget
from tests.helpers.kv_events import Publisher, batch


def target(on_events: Callable[[Sequence[KVEvent]], None], notes: list[str] | None = None) -> MirrorTarget:
    """A mirror target applying with ``on_events`` and noting resets and degradations."""
    noted = notes if notes is not None else []
    return MirrorTarget(
        on_events,
        lambda: noted.append("reset"),
        noted.append,
        lambda reason: noted.append(f"unsure: {reason}"),
    )


async def replay_scenario(
    tmp_path: Path, *, catch_up: bool
) -> tuple[KVEventSubscriber, Publisher, list[list[KVEvent]]]:
    """Batch 0 before the subscriber starts, 1, 2 lost on the wire, 3-5 (5 clears the cache)."""
    publisher = Publisher(tmp_path)
    received: list[list[KVEvent]] = []
    done = asyncio.Event()

    def on_events(events: Sequence[KVEvent]) -> None:
        received.append(list(events))
        if isinstance(events[0], AllBlocksCleared):
            done.set()

    await publisher.publish(0)  # published before anyone listens: only replay can recover it
    subscriber = KVEventSubscriber(
        publisher.endpoint, publisher.replay_endpoint, "kv", target(on_events), catch_up=catch_up
    )
    await subscriber.start()
    try:
        await asyncio.sleep(0.3)  # PUB/SUB joins asynchronously
        await publisher.publish(1)
        await publisher.publish(2, drop=True)  # lost on the wire
        for seq in (3, 4, 5):
            await publisher.publish(seq)
        async with asyncio.timeout(5):
            await done.wait()
    finally:
        await subscriber.stop()
        await publisher.close()
    return subscriber, publisher, received


async def without_replay(
    publisher: Publisher,
    on_events: Callable[[Sequence[KVEvent]], None],
    done: asyncio.Event,
    *,
    count: int = 3,
    dropped: frozenset[int] | set[int] = frozenset(),
) -> KVEventSubscriber:
    """Batches 0..count-1 (``dropped`` lost on the wire) to a subscriber with no replay socket."""
    subscriber = KVEventSubscriber(publisher.endpoint, None, "kv", target(on_events))
    await subscriber.start()
    try:
        await asyncio.sleep(0.3)  # PUB/SUB joins asynchronously
        for seq in range(count):
            await publisher.publish(seq, drop=seq in dropped)
        async with asyncio.timeout(5):
            await done.wait()
    finally:
        await subscriber.stop()
        await subscriber.stop()  # idempotent
        await publisher.close()
    return subscriber


@pytest.mark.timeout(60)
async def test_subscriber_converts_orders_and_replays_missed_batches(tmp_path: Path) -> None:
    subscriber, publisher, received = await replay_scenario(tmp_path, catch_up=True)
    assert subscriber.sequence.lost == 0 and publisher.replays == 2 and subscriber.sequence.replayed == 2
    assert received == [
        [BlockStored((0,), None, (0, 0, 0, 0), 4, medium="GPU")],
        [BlockStored((1,), 0, (1, 1, 1, 1), 4, medium="GPU")],
        [BlockStored((2,), 1, (2, 2, 2, 2), 4, medium="GPU")],
        [BlockRemoved((1,), medium="GPU")],
        [BlockStored((4,), 3, (4, 4, 4, 4), 4, medium="GPU")],
        [AllBlocksCleared()],
    ]


@pytest.mark.timeout(60)
async def test_without_catch_up_history_is_not_replayed_but_later_gaps_are(tmp_path: Path) -> None:
    subscriber, publisher, received = await replay_scenario(tmp_path, catch_up=False)
    # The start-up replay only tells where the history ends; the one after batch 3 fills batch 2.
    assert subscriber.sequence.lost == 0 and publisher.replays == 2 and subscriber.sequence.replayed == 1
    assert received[0] == [BlockStored((1,), 0, (1, 1, 1, 1), 4, medium="GPU")] and len(received) == 5


@pytest.mark.timeout(60)
async def test_the_answer_to_a_replay_that_timed_out_never_answers_a_later_one(tmp_path: Path) -> None:
    """The first replay is answered after its timeout: its end marker, arriving late, must not end
    a later replay before that one's batches came (they would be counted lost)."""
    publisher = Publisher(tmp_path, delays=(0.5,))
    received: list[list[KVEvent]] = []
    done = asyncio.Event()

    def on_events(events: Sequence[KVEvent]) -> None:
        received.append(list(events))
        if len(received) == 7:
            done.set()

    await publisher.publish(0)  # before anyone listens: only a replay brings it
    subscriber = KVEventSubscriber(
        publisher.endpoint, publisher.replay_endpoint, "kv", target(on_events), replay_idle_s=0.3
    )
    await subscriber.start()
    try:
        await asyncio.sleep(0.4)  # joined; the first replay timed out
        await publisher.publish(1)
        await publisher.publish(2, drop=True)
        await publisher.publish(3)
        await asyncio.sleep(0.6)  # the first replay's late answer has come by now
        await publisher.publish(4, drop=True)
        await publisher.publish(5, drop=True)
        await publisher.publish(6)
        async with asyncio.timeout(5):
            await done.wait()
    finally:
        await subscriber.stop()
        await publisher.close()
    assert subscriber.sequence.lost == 0 and subscriber.sequence.replayed == 4
    assert received[0] == [BlockStored((0,), None, (0, 0, 0, 0), 4, medium="GPU")]
    assert received[5] == [AllBlocksCleared()]


@pytest.mark.timeout(60)
async def test_without_replay_gaps_are_counted_and_stop_is_clean(tmp_path: Path) -> None:
    publisher = Publisher(tmp_path)
    received: list[int] = []
    done = asyncio.Event()

    def on_events(events: Sequence[KVEvent]) -> None:
        received.append(len(events))
        if len(received) == 2:
            done.set()

    subscriber = await without_replay(publisher, on_events, done, dropped={1})
    assert subscriber.sequence.lost == 1 and received == [1, 1]


@pytest.mark.timeout(60)
async def test_a_failing_callback_is_counted_and_later_batches_still_arrive(tmp_path: Path) -> None:
    publisher = Publisher(tmp_path)
    received: list[int] = []
    done = asyncio.Event()

    def on_events(events: Sequence[KVEvent]) -> None:
        received.append(len(events))
        if len(received) == 1:
            raise RuntimeError("the tree rejected the batch")
        done.set()

    subscriber = await without_replay(publisher, on_events, done, count=2)
    assert subscriber.callback_errors == 1 and subscriber.sequence.lost == 0 and received == [1, 1]


def test_a_chains_cache_salt_is_kept() -> None:
    """vLLM lists the salt among the first block's extra hash keys; later blocks inherit it."""

    def stored(parent: int | None, extra: list[tuple[object, ...] | None] | None) -> object:
        return vllm_events.BlockStored(
            block_hashes=[7],
            parent_block_hash=parent,
            token_ids=[1, 2, 3, 4],
            block_size=4,
            lora_id=None,
            medium="GPU",
            lora_name=None,
            extra_keys=extra,
        )

    salted = convert_event(stored(None, [("specrag-turbo",)]))
    assert isinstance(salted, BlockStored) and salted.cache_salt == "specrag-turbo"
    for event in (stored(None, None), stored(None, [None]), stored(3, [("specrag-turbo",)])):
        converted = convert_event(event)
        assert isinstance(converted, BlockStored) and converted.cache_salt is None


def sequence_of(notes: list[str], received: list[int], *, catch_up: bool = True) -> EventSequence:
    return EventSequence(target(lambda events: received.append(len(events)), notes), catch_up=catch_up)


def test_a_sequence_going_back_is_a_new_publisher_and_resets_the_mirror() -> None:
    notes: list[str] = []
    received: list[int] = []
    sequence = sequence_of(notes, received)
    for seq in range(4):
        assert sequence.missing_before(seq) is None
        sequence.deliver(seq, batch(seq))
    assert notes == ["reset"]  # catching up: the mirror follows the publisher from its batch 0
    assert sequence.missing_before(0) is None  # a restarted engine numbers from zero again
    assert notes == ["reset", "reset"] and sequence.sequence_resets == 1
    sequence.deliver(0, batch(0))
    assert sequence.missing_before(2) == 1  # and its own history is replayed from there
    assert received == [1, 1, 1, 1, 1] and sequence.lost == 0


def test_a_replay_that_starts_after_the_hole_counts_the_hole_lost() -> None:
    """Batches 1..10 missing, the replay holds only 8..10: 1..7 are lost, not skipped silently."""
    notes: list[str] = []
    received: list[int] = []
    sequence = sequence_of(notes, received)
    sequence.missing_before(0)
    sequence.deliver(0, batch(0))
    assert sequence.missing_before(11) == 1
    for seq in (8, 9, 10):
        sequence.deliver(seq, batch(seq), replayed=True)
    sequence.give_up(11)
    sequence.deliver(11, batch(11))
    assert sequence.lost == 7 and sequence.replayed == 3 and len(received) == 5
    assert notes == ["reset", "lost KV event batches 1..7"]


def test_an_unreadable_or_failing_batch_degrades_the_mirror() -> None:
    notes: list[str] = []

    def apply(events: Sequence[KVEvent]) -> None:
        raise ValueError("rejected")

    sequence = EventSequence(target(apply, notes), catch_up=False)
    sequence.missing_before(5)
    sequence.deliver(5, b"not msgpack")
    sequence.missing_before(6)
    sequence.deliver(6, batch(6))
    assert (sequence.undecodable, sequence.callback_errors, sequence.batches) == (1, 1, 1)
    assert notes == ["reset", "KV event batch 5 could not be read", "KV event batch 6 could not be applied"]


def test_group_and_medium_are_kept() -> None:
    removed = convert_event(vllm_events.BlockRemoved(block_hashes=[3], medium="CPU", group_idx=1))
    assert removed == BlockRemoved((3,), group_idx=1, medium="CPU")


@pytest.mark.timeout(60)
def test_a_subscriber_whose_loop_closed_under_it_ends_quietly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A service that ends without stopping its subscriber: the thread ends at its next batch,
    without an error in the logs (a traceback there reads as a fault)."""
    context = zmq.Context()
    pub = context.socket(zmq.PUB)
    pub.bind(f"ipc://{tmp_path}/pub")
    subscriber = KVEventSubscriber(f"ipc://{tmp_path}/pub", None, "kv", target(lambda events: None))
    loop = asyncio.new_event_loop()
    loop.run_until_complete(subscriber.start())
    loop.close()
    receiver = subscriber._receiver
    assert receiver is not None
    try:
        for seq in range(100):  # until the subscription has joined and a batch reached the thread
            pub.send_multipart((b"kv", seq.to_bytes(8, "big"), batch(seq)))
            receiver.join(0.1)
            if not receiver.is_alive():
                break
        assert not receiver.is_alive()
        assert [record for record in caplog.records if record.levelno >= logging.ERROR] == []
    finally:
        pub.close(linger=0)
        context.term()
