"""A KV-event publisher speaking vLLM's wire format, and a stand-in for the engine's prefix-cache
reset, for the KV-event subscriber's and the KV mirror's tests."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio
from vllm.distributed import kv_events as vllm_events

from specrag.errors import EngineError

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def batch(seq: int) -> bytes:
    """A real msgspec-encoded vLLM KVEventBatch; batch n stores block n, 3 removes block 1."""
    events: list[vllm_events.BlockStored | vllm_events.BlockRemoved | vllm_events.AllBlocksCleared]
    if seq == 3:
        events = [vllm_events.BlockRemoved(block_hashes=[1], medium="GPU")]
    elif seq == 5:
        events = [vllm_events.AllBlocksCleared()]
    else:
        events = [
            vllm_events.BlockStored(
                block_hashes=[seq],
                parent_block_hash=seq - 1 if seq else None,
                token_ids=[seq] * 4,
                block_size=4,
                lora_id=None,
                medium="GPU",
                lora_name=None,
            )
        ]
    return msgspec.msgpack.encode(vllm_events.KVEventBatch(ts=float(seq), events=events))


class Publisher:
    """PUB + ROUTER replay, like vLLM's ZmqEventPublisher, but able to drop batches on purpose, and
    to answer the n-th replay request ``delays[n]`` seconds late (what it holds then)."""

    def __init__(self, tmp_path: Path, *, delays: Sequence[float] = ()) -> None:
        self.endpoint = f"ipc://{tmp_path}/pub"
        self.replay_endpoint = f"ipc://{tmp_path}/replay"
        self.context = zmq.asyncio.Context()
        self.pub = self.context.socket(zmq.PUB)
        self.pub.bind(self.endpoint)
        self.router = self.context.socket(zmq.ROUTER)
        self.router.bind(self.replay_endpoint)
        self.sent: dict[int, bytes] = {}
        self.replays = 0
        self.delays = list(delays)
        self.late: set[asyncio.Task[None]] = set()
        self.server = asyncio.create_task(self._serve_replay())

    async def publish(self, seq: int, *, drop: bool = False) -> None:
        self.sent[seq] = batch(seq)
        if not drop:
            await self.pub.send_multipart((b"kv", seq.to_bytes(8, "big"), self.sent[seq]))

    async def _serve_replay(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            delay = self.delays[self.replays] if self.replays < len(self.delays) else 0.0
            self.replays += 1
            answer = self._answer(client, int.from_bytes(start, "big"), delay)
            if delay:
                task = asyncio.create_task(answer)
                self.late.add(task)
                task.add_done_callback(self.late.discard)
            else:
                await answer

    async def _answer(self, client: bytes, start: int, delay: float) -> None:
        await asyncio.sleep(delay)
        for seq in sorted(s for s in self.sent if s >= start):
            await self.router.send_multipart((client, b"", b"kv", seq.to_bytes(8, "big"), self.sent[seq]))
        await self.router.send_multipart((client, b"", b"", END_SEQ, b""))

    async def close(self) -> None:
        for task in (self.server, *self.late):
            task.cancel()
        self.pub.close(linger=0)
        self.router.close(linger=0)
        self.context.term()


class Resets:
    """The engine's prefix-cache reset: refused while ``busy``."""

    def __init__(self) -> None:
        self.busy = False
        self.calls = 0

    async def __call__(self) -> None:
        self.calls += 1
        if self.busy:
            raise EngineError("requests hold blocks")
