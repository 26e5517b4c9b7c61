"""Subscriber to vLLM's KV-cache event stream, feeding the knowledge tree's exact residency.

vLLM publishes ``(topic, sequence number, msgpack KVEventBatch)`` on a ZMQ PUB socket and keeps
recent batches for a ROUTER "replay" socket. PUB/SUB drops what a slow or late subscriber
misses, and a missed BlockRemoved would leave the tree believing evicted KV is still there, so
:class:`EventSequence` follows the publisher's sequence numbers:

- every gap (including the batches before the first one received) is filled from the replay
  socket before later batches are applied; what the replay cannot give is counted lost and the
  mirror told it is no longer exact (``degrade``);
- a number at or below the last one seen is a new publisher (a restarted engine numbers its
  batches from zero again): the mirror is reset and the new publisher's history replayed;
- a batch is decoded and converted whole before the mirror sees it, and the mirror applies it
  all or nothing (:meth:`KnowledgeTree.apply_events` checks every event first).

Events are decoded with vLLM's own msgspec classes and handed on as specrag.cache's plain
dataclasses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio
from vllm.distributed import kv_events as vllm_events

from specrag.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

__all__ = ["EventSequence", "KVEventSubscriber", "MirrorTarget", "convert_event", "first_block_salt"]

logger = logging.getLogger(__name__)

_END_OF_REPLAY = -1


def convert_event(event: object) -> KVEvent | None:
    """vLLM's event as specrag.cache's dataclass; None for kinds the tree does not use."""
    if isinstance(event, vllm_events.BlockStored):
        return BlockStored(
            block_hashes=tuple(event.block_hashes),
            parent_block_hash=event.parent_block_hash,
            token_ids=tuple(event.token_ids),
            block_size=event.block_size,
            cache_salt=first_block_salt(event),
            group_idx=event.group_idx,
            medium=event.medium,
        )
    if isinstance(event, vllm_events.BlockRemoved):
        return BlockRemoved(
            block_hashes=tuple(event.block_hashes), group_idx=event.group_idx, medium=event.medium
        )
    if isinstance(event, vllm_events.AllBlocksCleared):
        return AllBlocksCleared()
    return None


def first_block_salt(event: vllm_events.BlockStored) -> str | None:
    """The cache salt of a chain's first block: a string among its extra hash keys (vLLM lists
    the LoRA name, multimodal pairs, then the salt); None for a block with a parent or no salt."""
    extra = getattr(event, "extra_keys", None)
    if event.parent_block_hash is not None or not extra or not extra[0]:
        return None
    salts = [key for key in extra[0] if isinstance(key, str) and key != event.lora_name]
    return salts[-1] if salts else None


@dataclass(frozen=True)
class MirrorTarget:
    """What a KV event stream feeds: the mirror of one engine's prefix cache.

    ``apply`` takes one batch's events in order and applies all or none of them (raising when it
    applied none); ``reset`` says a new publisher started (a restarted engine: its cache starts
    empty); ``degrade`` says the stream lost something, with the reason: the mirror is no longer
    known to be exact until it is reset or sees the engine clear its cache.
    """

    apply: Callable[[Sequence[KVEvent]], None]
    reset: Callable[[], None]
    degrade: Callable[[str], None]


class EventSequence:
    """One subscriber's view of a publisher's numbered batches, and what it hands ``target``.

    Transport-free, so that the differential test drives exactly this with vLLM's own block pool:
    :meth:`missing_before` is asked for every live batch (it resets ``target`` at the first one
    when catching up, and whenever the number went backwards) and names the first batch to ask
    the replay for; :meth:`deliver` hands on a batch; :meth:`give_up` counts what neither the
    wire nor the replay brought.

    ``catch_up=False`` starts the sequence at the first batch received: for a subscriber that
    has just emptied the engine's cache, whose history is then irrelevant.
    """

    def __init__(self, target: MirrorTarget, *, catch_up: bool = True) -> None:
        self._target = target
        self._catch_up = catch_up
        self._decoder = msgspec.msgpack.Decoder(type=vllm_events.KVEventBatch)
        self._started = False
        self.last_seq = -1
        self.batches = 0
        self.replayed = 0
        self.lost = 0
        self.undecodable = 0  # batches received but not readable: lost to the mirror too
        self.callback_errors = 0
        self.sequence_resets = 0

    def missing_before(self, seq: int) -> int | None:
        """The first batch number missing before live batch ``seq`` (None: none is)."""
        if not self._started:
            self._started = True
            if self._catch_up:
                self._target.reset()  # the mirror follows this publisher from its batch 0
            else:
                self.last_seq = seq - 1  # the first batch starts the sequence
        elif seq <= self.last_seq:
            logger.warning(
                "KV event batch %d after %d: a new publisher; the cache mirror starts again",
                seq,
                self.last_seq,
            )
            self.sequence_resets += 1
            self.last_seq = -1
            self._target.reset()
        return self.last_seq + 1 if seq > self.last_seq + 1 else None

    def deliver(self, seq: int, payload: bytes, *, replayed: bool = False) -> None:
        """Hand on batch ``seq`` (an older or repeated one is ignored); a hole before it is lost."""
        if seq <= self.last_seq:
            return
        if seq > self.last_seq + 1:
            self.give_up(seq)
        self.last_seq = seq
        self.replayed += int(replayed)
        try:
            batch = self._decoder.decode(payload)
            events = [e for e in map(convert_event, batch.events) if e is not None]
        except (msgspec.DecodeError, msgspec.ValidationError, TypeError, ValueError):
            self.undecodable += 1
            logger.exception("undecodable KV event batch %d", seq)
            self._target.degrade(f"KV event batch {seq} could not be read")
            return
        self.batches += 1
        try:
            self._target.apply(events)
        except Exception:
            self.callback_errors += 1
            logger.exception("KV event batch %d could not be applied", seq)
            self._target.degrade(f"KV event batch {seq} could not be applied")

    def give_up(self, seq: int) -> None:
        """Count the batches between the last one handed on and ``seq`` as lost."""
        first, last = self.last_seq + 1, seq - 1
        if last < first:
            return
        self.lost += last - first + 1
        self.last_seq = last
        logger.warning("lost KV event batches %d..%d: the cache mirror is degraded", first, last)
        self._target.degrade(f"lost KV event batches {first}..{last}")


class KVEventSubscriber:
    """Receive vLLM KV-event batches in order and feed them to ``target`` (see :class:`EventSequence`).

    ``replay_endpoint=None`` disables gap filling (gaps are then counted lost). ``catch_up``
    (default) replays every batch the engine published before this subscriber's first one: what
    a mirror of an engine that already served requests needs; a caller that has just emptied the
    engine's cache (and told its tree so) passes ``catch_up=False``.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        topic: str,
        target: MirrorTarget,
        *,
        replay_timeout_s: float = 2.0,
        catch_up: bool = True,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.sequence = EventSequence(target, catch_up=catch_up)
        self._replay_timeout_s = replay_timeout_s
        self._context: zmq.asyncio.Context | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Connect and start receiving in a background task."""
        if self._task is not None:
            raise RuntimeError("the KV event subscriber is already running")
        self._context = zmq.asyncio.Context()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        self._sub.connect(self.endpoint)
        if self.replay_endpoint is not None:
            self._replay = self._context.socket(zmq.DEALER)
            self._replay.connect(self.replay_endpoint)
        self._task = asyncio.create_task(self._run(), name="kv-event-subscriber")

    async def stop(self) -> None:
        """Stop receiving and close the sockets; safe to call twice."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for socket in (self._sub, self._replay):
            if socket is not None:
                socket.close(linger=0)
        self._sub = self._replay = None
        if self._context is not None:
            self._context.term()
            self._context = None

    async def _run(self) -> None:
        assert self._sub is not None
        sequence = self.sequence
        while True:
            _topic, seq_bytes, payload = await self._sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            first_missing = sequence.missing_before(seq)
            if first_missing is not None:
                await self._replay_from(first_missing, seq)
            sequence.deliver(seq, payload)

    async def _replay_from(self, first: int, seq: int) -> None:
        """Ask the replay socket for everything from batch ``first`` on, and hand on those before
        live batch ``seq``; a replay that starts later than ``first`` leaves a hole, counted lost."""
        if self._replay is not None:
            await self._replay.send_multipart((b"", first.to_bytes(8, "big")))
            try:
                async with asyncio.timeout(self._replay_timeout_s):
                    while True:
                        frames = await self._replay.recv_multipart()
                        replay_seq = int.from_bytes(frames[-2], "big", signed=True)
                        if replay_seq == _END_OF_REPLAY:
                            break
                        if replay_seq < seq:
                            self.sequence.deliver(replay_seq, frames[-1], replayed=True)
            except TimeoutError:
                logger.warning("KV event replay from %s timed out", self.replay_endpoint)
        self.sequence.give_up(seq)
