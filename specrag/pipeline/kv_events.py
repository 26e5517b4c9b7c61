"""Subscriber to vLLM's KV-cache event stream, feeding the knowledge tree's exact residency.

vLLM publishes ``(topic, sequence number, msgpack KVEventBatch)`` on a ZMQ PUB socket and keeps
recent batches for a ROUTER "replay" socket. PUB/SUB drops what a slow or late subscriber
misses, and a missed BlockRemoved would leave the tree believing evicted KV is still there, so
every gap in the sequence numbers (including the ones before the first batch received) is
filled from the replay socket before later batches are applied. Events are decoded with
vLLM's own msgspec classes and handed on as specrag.cache's plain dataclasses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence

import msgspec
import zmq
import zmq.asyncio
from vllm.distributed import kv_events as vllm_events

from specrag.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

__all__ = ["KVEventSubscriber", "convert_event", "first_block_salt"]

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
        )
    if isinstance(event, vllm_events.BlockRemoved):
        return BlockRemoved(block_hashes=tuple(event.block_hashes))
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


class KVEventSubscriber:
    """Receive vLLM KV-event batches in order and pass their events to ``on_events``.

    ``replay_endpoint=None`` disables gap filling (gaps are then only counted). The callback
    runs on the event loop, once per batch, in sequence order; an exception in it is logged and
    does not stop the subscriber.

    ``catch_up`` (default) replays every batch the engine published before this subscriber's
    first one: what a mirror of an engine that already served requests needs. A caller that has
    just emptied the engine's cache (and told its tree so) passes ``catch_up=False``: history is
    then irrelevant, and on a long-running engine replaying thousands of batches would time out
    and count them lost.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        topic: str,
        on_events: Callable[[Sequence[KVEvent]], None],
        *,
        replay_timeout_s: float = 2.0,
        catch_up: bool = True,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self._on_events = on_events
        self._replay_timeout_s = replay_timeout_s
        self._catch_up = catch_up
        self._decoder = msgspec.msgpack.Decoder(type=vllm_events.KVEventBatch)
        self._context: zmq.asyncio.Context | None = None
        self._sub: zmq.asyncio.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self.last_seq = -1
        self.batches = 0
        self.replayed = 0
        self.lost = 0
        self.undecodable = 0  # batches received but not readable: lost to the mirror too
        self.callback_errors = 0

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
        while True:
            _topic, seq_bytes, payload = await self._sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if self.batches == 0 and not self._catch_up:
                self.last_seq = max(self.last_seq, seq - 1)  # the first batch starts the sequence
            if seq <= self.last_seq:
                continue
            if seq > self.last_seq + 1:
                await self._fill_gap(seq)
            if seq > self.last_seq:
                self._deliver(seq, payload)

    async def _fill_gap(self, seq: int) -> None:
        """Ask the replay socket for everything from the first missing batch on."""
        if self._replay is not None:
            await self._replay.send_multipart((b"", (self.last_seq + 1).to_bytes(8, "big")))
            try:
                async with asyncio.timeout(self._replay_timeout_s):
                    while True:
                        frames = await self._replay.recv_multipart()
                        replay_seq = int.from_bytes(frames[-2], "big", signed=True)
                        if replay_seq == _END_OF_REPLAY:
                            break
                        if self.last_seq < replay_seq < seq:
                            self.replayed += 1
                            self._deliver(replay_seq, frames[-1])
            except TimeoutError:
                logger.warning("KV event replay from %s timed out", self.replay_endpoint)
        if seq > self.last_seq + 1:
            self.lost += seq - self.last_seq - 1
            logger.warning(
                "lost KV event batches %d..%d: the cache mirror may drift", self.last_seq + 1, seq - 1
            )

    def _deliver(self, seq: int, payload: bytes) -> None:
        self.last_seq = seq
        try:
            batch = self._decoder.decode(payload)
        except msgspec.DecodeError:
            self.undecodable += 1
            logger.exception("undecodable KV event batch %d", seq)
            return
        self.batches += 1
        events = [e for e in map(convert_event, batch.events) if e is not None]
        try:
            self._on_events(events)
        except Exception:
            self.callback_errors += 1
            logger.exception("KV event callback failed on batch %d", seq)
