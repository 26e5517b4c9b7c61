"""A KV-event publisher speaking vLLM's wire format, and a stand-in for the engine's prefix-cache
reset, for the KV-event subscriber's and the KV mirror's tests."""

from __future__ import annotations

import asyncio
import time
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
    """PUB + ROUTER replay, like vLLM's ZmqEventPublisher (ZMQ's default high-water marks, as vLLM
    keeps on its ROUTER), but able to drop batches on purpose, to answer the n-th replay request
    ``delays[n]`` seconds late (what it holds then), to leave out of the n-th answer the batches in
    ``gaps[n]`` and then its end marker too (as a ROUTER past its high-water mark drops frames), and
    to send an answer's frames ``pace_s`` apart (a slow replay). ``starts`` lists the batch each
    replay request asked from."""

    def __init__(
        self,
        tmp_path: Path,
        *,
        delays: Sequence[float] = (),
        gaps: Sequence[frozenset[int]] = (),
        pace_s: float = 0.0,
    ) -> None:
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
        self.gaps = list(gaps)
        self.pace_s = pace_s
        self.starts: list[int] = []
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
            gap = self.gaps[self.replays] if self.replays < len(self.gaps) else frozenset()
            self.replays += 1
            self.starts.append(int.from_bytes(start, "big"))
            answer = self._answer(client, self.starts[-1], delay, gap)
            if delay or self.pace_s:
                task = asyncio.create_task(answer)
                self.late.add(task)
                task.add_done_callback(self.late.discard)
            else:
                await answer

    async def _answer(self, client: bytes, start: int, delay: float, gap: frozenset[int]) -> None:
        await asyncio.sleep(delay)
        for seq in sorted(s for s in self.sent if s >= start):
            if seq not in gap:
                await self.router.send_multipart((client, b"", b"kv", seq.to_bytes(8, "big"), self.sent[seq]))
            if self.pace_s:
                await asyncio.sleep(self.pace_s)
        if not gap:
            await self.router.send_multipart((client, b"", b"", END_SEQ, b""))

    async def close(self) -> None:
        for task in (self.server, *self.late):
            task.cancel()
        self.pub.close(linger=0)
        self.router.close(linger=0)
        self.context.term()


def hold_the_loop(seconds: float) -> None:
    """The service's loop busy answering something else: nothing else runs on it meanwhile."""
    time.sleep(seconds)


class Resets:
    """The engine's prefix-cache reset: refused while ``busy``."""

    def __init__(self) -> None:
        self.busy = False
        self.calls = 0

    async def __call__(self) -> None:
        self.calls += 1
        if self.busy:
            raise EngineError("requests hold blocks")
