"""A publisher's numbered KV-event batches followed in order, transport-free.

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
dataclasses. Kept free of sockets and threads so that the differential test drives exactly this
with vLLM's own block pool; :mod:`.reassembly` drives it from the subscriber's receiving thread.
"""

from __future__ import annotations

import logging

import msgspec
from vllm.distributed import kv_events as vllm_events

from specrag.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from specrag.pipeline.kv_mirror.target import MirrorTarget, apply_batch

__all__ = ["EventSequence", "convert_event", "first_block_salt"]

logger = logging.getLogger(__name__)


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
            self.new_publisher(seq)
        return self.last_seq + 1 if seq > self.last_seq + 1 else None

    def new_publisher(self, seq: int) -> None:
        """Live batch ``seq`` comes from a new publisher (a restarted engine): follow it from its
        batch 0, with an empty tree."""
        logger.warning(
            "KV event batch %d after %d: a new publisher; the cache mirror starts again", seq, self.last_seq
        )
        self.sequence_resets += 1
        self.last_seq = -1
        self._opening = False
        self._target.reset()

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
        if not apply_batch(self._target, seq, events):
            self.callback_errors += 1

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
