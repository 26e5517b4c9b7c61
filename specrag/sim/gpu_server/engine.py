"""The stand-in's engine: vLLM's step loop over a :class:`PrefixCache`, timed by a :class:`TimeModel`.

Each step is vLLM V1's: the running requests first (a decode token each, or their prefill's next
chunk), then waiting requests admitted in arrival order while the step's token budget, the
running limit and the cache allow, each with its prefix hit taken at admission. The step then
takes the time model's duration of real time; at its end the blocks it completed enter the cache,
its KV events go out as one ``KVEventBatch`` (vLLM publishes once per step), and each request
that finished its prefill in it gets its first token. A request's record keeps its modelled time
to first token (from its arrival to the end of that step, as planned) and how late the loop
actually woke (the machine's delay, not the model's).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed import kv_events as vllm_events
from vllm.v1.core.kv_cache_utils import BlockHash

from specrag.errors import InvalidInputError
from specrag.sim.gpu_server.prefix_cache import PrefixCache
from specrag.sim.gpu_server.time_model import TimeModel

__all__ = ["FINISHED", "Request", "RequestRecord", "StepEngine"]

FINISHED = -1
"""What a request's queue carries after its last token."""

RECORDS_KEPT = 200_000


@dataclass(frozen=True)
class RequestRecord:
    """One request as the stand-in served it, for a benchmark that subtracts the engine's own time."""

    request_id: str
    prompt_tokens: int
    cached_tokens: int
    modelled_ttft_s: float | None  # None: it never got a first token
    late_s: float
    aborted: bool


@dataclass(eq=False)
class Request:
    """A request from its arrival to its end; ``tokens`` carries generated ids, then :data:`FINISHED`."""

    request_id: str
    prompt: list[int]
    max_tokens: int
    arrival: float
    tokens: asyncio.Queue[int] = field(default_factory=asyncio.Queue)
    hashes: list[BlockHash] = field(default_factory=list)
    held: list[BlockHash] = field(default_factory=list)  # its cached blocks, in prompt order
    fresh: int = 0  # its blocks not cached yet
    computed: int = 0  # prompt tokens whose KV exists (cache hits included)
    generated: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    modelled_ttft_s: float | None = None
    late_s: float = 0.0
    ended: bool = False

    @property
    def prefilled(self) -> bool:
        return self.computed == len(self.prompt)


class StepEngine:
    """Runs steps while requests wait or run; ``publish`` sends each step's events (vLLM's
    ``ZmqEventPublisher.publish``, or a test's list)."""

    def __init__(
        self,
        cache: PrefixCache,
        model: TimeModel,
        publish: Callable[[vllm_events.KVEventBatch], None],
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.cache = cache
        self.model = model
        self._publish = publish
        self._clock = clock
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.records: deque[RequestRecord] = deque(maxlen=RECORDS_KEPT)
        self.steps = 0
        self.published_events = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="standin-steps")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for request in [*self.waiting, *self.running]:
            self.abort(request)

    def submit(self, request: Request) -> None:
        """Queue ``request``; its tokens arrive on its queue."""
        blocks = -(-(len(request.prompt) + request.max_tokens) // self.cache.block_size)
        if blocks > self.cache.num_blocks:
            raise InvalidInputError(
                f"the prompt and its max_tokens need {blocks} KV blocks; "
                f"this engine has {self.cache.num_blocks}"
            )
        request.hashes = self.cache.hash_blocks(request.prompt)
        self.waiting.append(request)
        self._wake.set()

    def abort(self, request: Request) -> None:
        """The client left: free what the request holds (its computed blocks stay cached)."""
        if request.ended:
            return
        if request in self.waiting:
            self.waiting.remove(request)
        else:
            self._end(request, aborted=True)
            return
        request.ended = True
        self._record(request, aborted=True)

    def reset_prefix_cache(self) -> bool:
        """vLLM's reset: refused while a request holds blocks; the clear is published at once."""
        done = self.cache.reset()
        if done:
            self._publish_events()
        return done

    async def _loop(self) -> None:
        while True:
            if not self.waiting and not self.running:
                self._wake.clear()
                await self._wake.wait()
            start = self._clock()
            chunks = self._schedule()
            planned_end = start + self.model.step_duration_s(sum(chunks.values()))
            await asyncio.sleep(max(0.0, planned_end - self._clock()))
            late = max(0.0, self._clock() - planned_end)
            self.steps += 1
            self._complete(chunks, planned_end, late)

    def _schedule(self) -> dict[Request, int]:
        """This step's work: each request's prompt tokens to compute (0 for a decode)."""
        budget = self.model.max_num_batched_tokens
        chunks: dict[Request, int] = {}
        for request in self.running:
            if budget <= 0:
                break
            chunk = 0 if request.prefilled else min(len(request.prompt) - request.computed, budget)
            chunks[request] = chunk
            budget -= max(chunk, 1)
        while self.waiting and budget > 0 and len(self.running) < self.model.max_num_seqs:
            request = self.waiting[0]
            hits = request.hashes[: self.cache.leading_hits(request.hashes, len(request.prompt))]
            blocks = -(-(len(request.prompt) + request.max_tokens) // self.cache.block_size)
            if not self.cache.can_hold(hits, blocks - len(hits)):
                break
            self.waiting.popleft()
            self.cache.acquire(hits, blocks - len(hits), len(request.prompt))
            request.held, request.fresh = list(hits), blocks - len(hits)
            request.computed = request.cached_tokens = len(hits) * self.cache.block_size
            self.running.append(request)
            chunks[request] = min(len(request.prompt) - request.computed, budget)
            budget -= chunks[request]
        return chunks

    def _complete(self, chunks: dict[Request, int], planned_end: float, late: float) -> None:
        for request, chunk in chunks.items():
            if request.ended:  # aborted during the step
                continue
            was_prefilled = request.prefilled
            request.computed += chunk
            if request.prefilled:
                token = request.prompt[-1]
                request.generated.append(token)
                if not was_prefilled:
                    request.modelled_ttft_s = planned_end - request.arrival
                    request.late_s = late
                request.tokens.put_nowait(token)
            self._commit_blocks(request)
            if len(request.generated) >= request.max_tokens:
                self._end(request, aborted=False)
        self._publish_events()

    def _commit_blocks(self, request: Request) -> None:
        """Cache the request's blocks whose KV is complete: its computed prompt and the generated
        tokens fed back since (the last one's KV is computed by the next step)."""
        size = self.cache.block_size
        kv_tokens = request.computed + max(0, len(request.generated) - 1)
        full = kv_tokens // size
        done = len(request.held)
        if full <= done:
            return
        tokens = (request.prompt + request.generated)[done * size : full * size]
        parent = request.held[-1] if request.held else None
        known = request.hashes[done:full]
        hashes = known + self.cache.hash_blocks(tokens[len(known) * size :], known[-1] if known else parent)
        self.cache.commit(hashes, parent, tokens)
        request.held += hashes
        request.fresh -= len(hashes)

    def _end(self, request: Request, *, aborted: bool) -> None:
        request.ended = True
        self.running.remove(request)
        self.cache.release(request.held, request.fresh)
        request.held, request.fresh = [], 0
        request.tokens.put_nowait(FINISHED)
        self._record(request, aborted=aborted)
        self._wake.set()

    def _record(self, request: Request, *, aborted: bool) -> None:
        self.records.append(
            RequestRecord(
                request.request_id,
                len(request.prompt),
                request.cached_tokens,
                request.modelled_ttft_s,
                request.late_s,
                aborted,
            )
        )

    def _publish_events(self) -> None:
        events = self.cache.take_events()
        if events:
            self.published_events += len(events)
            self._publish(vllm_events.KVEventBatch(ts=time.time(), events=events))

    def counts(self) -> dict[str, Any]:
        return {"running": len(self.running), "waiting": len(self.waiting)}
