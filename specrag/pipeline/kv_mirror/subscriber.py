"""Subscriber to vLLM's KV-cache event stream, feeding the knowledge tree's exact residency.

vLLM publishes ``(topic, sequence number, msgpack KVEventBatch)`` on a ZMQ PUB socket and keeps
recent batches for a ROUTER "replay" socket. PUB/SUB drops what a slow or late subscriber
misses, and a missed BlockRemoved would leave the tree believing evicted KV is still there, so
:class:`EventSequence` follows the publisher's sequence numbers:

- the mirror follows the publisher once the subscription has *joined*: the SUB socket's
  handshake with the publisher succeeded, and then a replay from batch 0 answered (ZMQ
  subscriptions join asynchronously: what is published before the join is only in the replay
  buffer). A subscriber that catches up applies that replay: the publisher's whole history when
  its buffer still starts at batch 0, or an empty one when it has published nothing (a fresh
  engine, whose cache is empty); a history whose start the buffer no longer holds leaves the
  mirror unsure (``unsure``), not in loss: nothing the mirror followed went missing. Without a
  replay answer, the first batch received opens the sequence;
- every later gap is filled from the replay socket before later batches are applied; what the
  replay cannot give is counted lost and the mirror told it is no longer exact (``degrade``);
- a number at or below the last one seen is a new publisher (a restarted engine numbers its
  batches from zero again): the mirror is reset and the new publisher's history replayed;
- a batch is decoded and converted whole before the mirror sees it, and the mirror applies it
  all or nothing (:meth:`KnowledgeTree.apply_events` checks every event first).

Events are decoded with vLLM's own msgspec classes and handed on as specrag.cache's plain
dataclasses.
"""

from __future__ import annotations

import asyncio
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
    applied none); ``reset`` says the mirror follows a publisher from its batch 0 on (a new
    publisher, or the subscription joined: the tree starts empty); ``degrade`` says the stream
    lost something, with the reason: the mirror is no longer known to be exact until it is reset
    or sees the engine clear its cache; ``unsure`` says it cannot know the engine's cache although
    nothing it followed was lost (a history older than the replay buffer, a subscriber that
    stopped): no reason to empty the engine's cache.
    """

    apply: Callable[[Sequence[KVEvent]], None]
    reset: Callable[[], None]
    degrade: Callable[[str], None]
    unsure: Callable[[str], None]


class EventSequence:
    """One subscriber's view of a publisher's numbered batches, and what it hands ``target``.

    Transport-free, so that the differential test drives exactly this with vLLM's own block pool:
    :meth:`open` starts following the publisher once the subscription has joined;
    :meth:`missing_before` is asked for every live batch (it opens the sequence at the first one
    if nothing did, and resets ``target`` whenever the number went backwards) and names the first
    batch to ask the replay for; :meth:`deliver` hands on a batch; :meth:`skip` passes over one
    of a history not needed; :meth:`give_up` counts what neither the wire nor the replay brought.

    ``catch_up=False`` skips the publisher's history (the batches the start-up replay returns,
    or those before the first one received): for a subscriber that has just emptied the
    engine's cache, whose history is then irrelevant.
    """

    def __init__(self, target: MirrorTarget, *, catch_up: bool = True) -> None:
        self._target = target
        self.catch_up = catch_up
        self._decoder = msgspec.msgpack.Decoder(type=vllm_events.KVEventBatch)
        self.started = False
        # Opened, and no batch delivered since: a hole now is history the replay no longer holds.
        self._opening = False
        self.last_seq = -1
        self.batches = 0
        self.replayed = 0
        self.lost = 0
        self.undecodable = 0  # batches received but not readable: lost to the mirror too
        self.callback_errors = 0
        self.sequence_resets = 0

    def open(self) -> None:
        """The subscription has joined: follow the publisher from its batch 0 on, with an empty
        tree (catching up, the history then comes as batches from 0; else it is skipped)."""
        self.started = True
        self._opening = True
        self.last_seq = -1
        self._target.reset()

    def missing_before(self, seq: int) -> int | None:
        """The first batch number missing before live batch ``seq`` (None: none is)."""
        if not self.started:
            self.open()  # no replay answered before this batch: it proves the join
            if not self.catch_up:
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
        self._opening = False
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

    def skip(self, seq: int) -> None:
        """Pass over batch ``seq`` of a history not needed (``catch_up=False``)."""
        self.last_seq = max(self.last_seq, seq)
        self._opening = False

    def give_up(self, seq: int) -> None:
        """Count the batches between the last one handed on and ``seq`` as lost; before the first
        batch of a history they are not lost but unknown (the replay buffer no longer starts at
        the publisher's batch 0): the mirror is unsure, and nothing it followed went missing."""
        first, last = self.last_seq + 1, seq - 1
        if last < first:
            return
        self.last_seq = last
        if self._opening and self.catch_up:
            logger.info(
                "KV event batches %d..%d are no longer replayable: the cache mirror is unsure", first, last
            )
            self._target.unsure(
                f"the engine's KV event batches {first}..{last} (its history before this subscriber) "
                "are no longer in its replay buffer"
            )
            return
        self.lost += last - first + 1
        logger.warning("lost KV event batches %d..%d: the cache mirror is degraded", first, last)
        self._target.degrade(f"lost KV event batches {first}..{last}")


class KVEventSubscriber:
    """Receive vLLM KV-event batches in order and feed them to ``target`` (see :class:`EventSequence`).

    ``replay_endpoint=None`` disables gap filling (gaps are then counted lost, and the first batch
    received opens the sequence). ``catch_up`` (default) replays every batch the engine published
    before the subscription joined: what a mirror of an engine that already served requests
    needs; a caller that has just emptied the engine's cache (and told its tree so) passes
    ``catch_up=False``.

    ``joined`` is set once the sequence is open. ``failure`` holds what stopped the receiving task
    when it ended by itself (the target is told it is unsure): its owner subscribes again.
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
        self.joined = asyncio.Event()
        self.failure: BaseException | None = None
        self._target = target
        self._replay_timeout_s = replay_timeout_s
        self._context: zmq.asyncio.Context | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Connect and start receiving in a background task."""
        if self._task is not None:
            raise RuntimeError("the KV event subscriber is already running")
        self._context = zmq.asyncio.Context()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        # Watched before connecting, so that the handshake cannot be missed.
        self._monitor = self._sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self._sub.connect(self.endpoint)
        self._task = asyncio.create_task(self._run(), name="kv-event-subscriber")
        self._task.add_done_callback(self._ended)

    async def stop(self) -> None:
        """Stop receiving and close the sockets; safe to call twice."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait([task])  # a task that failed before holds it in ``failure``
        self._close_monitor()
        if self._sub is not None:
            self._sub.close(linger=0)
            self._sub = None
        if self._context is not None:
            self._context.term()
            self._context = None

    def _ended(self, task: asyncio.Task[None]) -> None:
        """The receiving task ended: by :meth:`stop`, or by an error nothing else would see."""
        if task.cancelled():
            return
        self.failure = task.exception() or RuntimeError("the receiving task returned")
        logger.error("the KV event subscriber for %s stopped", self.endpoint, exc_info=self.failure)
        self._target.unsure(f"the KV event subscriber stopped: {self.failure!r}")

    def _close_monitor(self) -> None:
        if self._monitor is not None:
            assert self._sub is not None
            self._sub.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None

    async def _run(self) -> None:
        assert self._sub is not None and self._monitor is not None
        await self._monitor.recv_multipart()  # the SUB socket's handshake with the publisher
        self._close_monitor()
        await self._open()
        sequence = self.sequence
        while True:
            _topic, seq_bytes, payload = await self._sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if not sequence.started:
                await self._open(before=seq)
            first_missing = sequence.missing_before(seq)
            self.joined.set()
            if first_missing is not None:
                await self._replay_from(first_missing, seq)
            sequence.deliver(seq, payload)

    async def _open(self, before: int | None = None) -> None:
        """Open the sequence with a replay from batch 0, asked after the SUB socket's handshake:
        its answer proves the join (a batch published after it reaches the SUB socket, one
        published before is in the answer). Catching up, the answer is applied (empty: the
        publisher published nothing yet, its engine's cache is empty); else only its last
        number is kept. Without an answer the sequence stays closed until a live batch opens it
        (``before``: the live batch that came first; batches from it on are not replayed)."""
        if self.replay_endpoint is None:
            return
        batches, complete = await self._replayed(0)
        history = [(seq, payload) for seq, payload in batches if before is None or seq < before]
        if not history and not (complete and before is None):
            return
        sequence = self.sequence
        sequence.open()
        for seq, payload in history:
            if sequence.catch_up:
                sequence.deliver(seq, payload, replayed=True)
            else:
                sequence.skip(seq)
        self.joined.set()

    async def _replay_from(self, first: int, seq: int) -> None:
        """Ask the replay socket for everything from batch ``first`` on, and hand on those before
        live batch ``seq``; a replay that starts later than ``first`` leaves a hole, counted lost."""
        if self.replay_endpoint is not None:
            batches, _complete = await self._replayed(first)
            for replay_seq, payload in batches:
                if replay_seq < seq:
                    self.sequence.deliver(replay_seq, payload, replayed=True)
        self.sequence.give_up(seq)

    async def _replayed(self, first: int) -> tuple[list[tuple[int, bytes]], bool]:
        """The replay socket's batches from ``first`` on, and whether its end marker came in time.

        Each request has a DEALER socket of its own, closed after it: the answer to a request
        that timed out goes to a closed socket (ROUTER drops it) and can never be taken for the
        answer to a later one.
        """
        assert self._context is not None and self.replay_endpoint is not None
        dealer = self._context.socket(zmq.DEALER)
        batches: list[tuple[int, bytes]] = []
        try:
            dealer.connect(self.replay_endpoint)
            await dealer.send_multipart((b"", first.to_bytes(8, "big")))
            async with asyncio.timeout(self._replay_timeout_s):
                while True:
                    frames = await dealer.recv_multipart()
                    replay_seq = int.from_bytes(frames[-2], "big", signed=True)
                    if replay_seq == _END_OF_REPLAY:
                        return batches, True
                    batches.append((replay_seq, frames[-1]))
        except TimeoutError:
            logger.warning("KV event replay from %s timed out", self.replay_endpoint)
            return batches, False
        finally:
            dealer.close(linger=0)
