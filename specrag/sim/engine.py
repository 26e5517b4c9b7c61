"""A simulated engine with vLLM's prefix-cache semantics and a measured time model.

Why it exists: unit tests of the controller need an engine that starts in no time, behaves the
same on every run and can be made to fail on purpose; large simulations (thousands of requests,
eviction pressure) need one that costs no CPU per token. It is never the product default: every
figure on the compass comes from a real engine.

What it reproduces of vLLM v1 (checked against the real engine in tests/sim/test_engine.py):

- **APC.** A prompt is split into full blocks of ``block_size`` tokens, each keyed by a chained
  content key (parent key + block tokens, :func:`specrag.cache.residency.chain_block_keys`). A
  request's cache hit is the longest run of resident blocks from the first one, capped at
  ``(prompt_tokens - 1) // block_size`` blocks: vLLM must compute at least the last prompt token to
  get logits, so an exact repeat recomputes its last full block (a prompt of 1024 tokens with
  32-token blocks reports 992 cached tokens the second time, one of 1000 tokens also 992).
- **Blocks enter the cache as the prefill progresses.** Each engine step computes a chunk; the full
  blocks it completes become resident at the end of the step, so a request aborted mid-prefill
  leaves the chunks computed so far reusable. Output tokens fill blocks too, as in vLLM.
- **Block pool and eviction.** ``capacity_blocks`` blocks in the shared model of vLLM's pool
  (:class:`specrag.cache.residency.BlockPool`, also the knowledge tree's capacity model): a
  running request holds its blocks, a finished one returns them tail first to an LRU free list,
  and allocating a block evicts the least recently freed cached block. Running out of blocks
  preempts the newest running request (recompute, as vLLM does). ``reset_prefix_cache`` refuses
  while blocks are in use, like vLLM.
- **Scheduling.** One step loop task: running requests first, then waiting ones in arrival order,
  within ``max_num_batched_tokens`` per step, each prefill chunk capped at
  ``long_prefill_token_threshold``; decoding requests take one token per step. A request's first
  token comes at the end of the step that computes its last prompt token, so head-of-line waits
  and "abort takes effect after the current step" fall out of the loop, not special cases.
- **Abort.** Like ``AsyncLLM``: the stream ends at once with an empty output whose
  ``finish_reason`` is ``"abort"``, while the engine drops the request at its next step.
- **Document KV** (``document_kv=True``; docs/turbo.md). A request with spans to load runs under
  its cache salt (its chain keyed from :func:`specrag.cache.residency.salted_root`, its first
  block's event carrying the salt, as vLLM publishes it); when first scheduled, every token from
  its cache hit to the end of its last span is loaded at no compute cost, counted as cached and
  reported as ``document_kv_tokens`` with the finished output, as TurboRAG's connector does. There
  is no store: every span counts as stored (the real engine prefills when one is missing).

Time: a step lasts ``step_overhead_s`` + the prefill cost of its chunks + ``decode_step_s`` when
any request decodes, multiplied by ``time_scale`` and slept with ``asyncio.sleep`` (0.01 makes
tests 100x faster; 0 only yields). :attr:`SimulatedEngine.simulated_time_s` adds the unscaled
step times, for simulations that report engine time.

Outputs are synthetic: token IDs drawn from a generator seeded by the prompt (and the sampling
seed), so the same prompt always gives the same answer; the text is the IDs written out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncGenerator, Callable, Sequence

from specrag.cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from specrag.cache.residency import ROOT_KEY, BlockPool, chain_block_keys, salted_root
from specrag.errors import EngineError, InvalidInputError
from specrag.pipeline.engines.base import EngineBase
from specrag.pipeline.engines.protocol import EngineCounts, EngineOutput, Sampling, now
from specrag.sim.requests import SimRequest, TimeModel, synthetic_answer

__all__ = ["KVEventCallback", "SimulatedEngine"]

logger = logging.getLogger(__name__)

_TIMER_GRANULARITY_S = 0.002

KVEventCallback = Callable[[Sequence[KVEvent]], None]
"""Receives one step's KV events, in order: the same shape as KVEventSubscriber's callback."""


class SimulatedEngine(EngineBase):
    """:class:`specrag.pipeline.engines.protocol.Engine` simulated in the event loop (see the module doc).

    Fault injection for reliability tests: :meth:`fail_next`, :meth:`stall` / :meth:`resume`,
    :meth:`hang` and :meth:`die`. ``on_kv_events`` receives each step's BlockStored /
    BlockRemoved / AllBlocksCleared events, keyed by content key (the parent of a first block is
    None), so the knowledge tree can mirror this engine exactly as it mirrors vLLM.

    The scheduling knobs default to :class:`specrag.pipeline.engines.config.EngineConfig`'s; the pool
    holds ``capacity_blocks`` blocks and must fit one ``max_model_len`` request, as vLLM requires.
    """

    def __init__(
        self,
        *,
        block_size: int = 32,
        max_model_len: int = 8192,
        capacity_blocks: int = 8192,
        max_num_batched_tokens: int = 512,
        long_prefill_token_threshold: int = 256,
        max_num_seqs: int = 64,
        time_model: TimeModel | None = None,
        time_scale: float = 1.0,
        vocab_size: int = 1024,
        on_kv_events: KVEventCallback | None = None,
        document_kv: bool = False,
    ) -> None:
        positive = {
            "block_size": block_size,
            "max_model_len": max_model_len,
            "capacity_blocks": capacity_blocks,
            "max_num_batched_tokens": max_num_batched_tokens,
            "long_prefill_token_threshold": long_prefill_token_threshold,
            "max_num_seqs": max_num_seqs,
        }
        for name, value in positive.items():
            if value < 1:
                raise InvalidInputError(f"simulated engine: {name} must be positive, got {value}")
        if time_scale < 0:
            raise InvalidInputError(f"simulated engine: time_scale must be >= 0, got {time_scale}")
        if vocab_size <= 3:
            raise InvalidInputError(f"simulated engine: vocab_size must exceed 3, got {vocab_size}")
        if capacity_blocks * block_size < max_model_len:
            # vLLM refuses to start in this case too: one maximal request could never be scheduled.
            raise InvalidInputError(
                f"simulated engine: {capacity_blocks} blocks of {block_size} tokens cannot hold "
                f"one request of max_model_len {max_model_len}"
            )
        super().__init__()
        self._block_size = block_size
        self._max_model_len = max_model_len
        self._max_batched = max_num_batched_tokens
        self._chunk = long_prefill_token_threshold
        self._max_seqs = max_num_seqs
        self._time = time_model or TimeModel()
        self._time_scale = time_scale
        self._vocab_size = vocab_size
        self._on_kv_events = on_kv_events
        self._document_kv = document_kv
        self._capacity_blocks = capacity_blocks
        self._pool = BlockPool(capacity_blocks)
        self._events: list[KVEvent] = []
        self._requests: dict[str, SimRequest] = {}
        self._waiting: deque[SimRequest] = deque()
        self._running: list[SimRequest] = []
        self._work = asyncio.Event()
        self._unstalled = asyncio.Event()
        self._unstalled.set()
        self._loop_task: asyncio.Task[None] | None = None
        self._failures: deque[Exception] = deque()
        self._deadline = 0.0
        self.simulated_time_s = 0.0
        self.steps = 0

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def kv_capacity_tokens(self) -> int | None:
        return self._capacity_blocks * self._block_size

    @property
    def batched_token_budget(self) -> int:
        return self._max_batched

    @property
    def supports_document_kv(self) -> bool:
        return self._document_kv

    @property
    def cached_blocks(self) -> int:
        """Blocks whose KV is resident and reusable (in use or not yet evicted)."""
        return len(self._pool)

    def _engine_waiting(self) -> int:
        return len(self._waiting)

    async def _counts(self) -> EngineCounts:
        """Exact engine state: requests scheduled, queued, and not yet finished or aborted."""
        unfinished = sum(1 for request in self._requests.values() if not request.aborted)
        return EngineCounts(running=len(self._running), waiting=len(self._waiting), unfinished=unfinished)

    async def _stream(
        self, request_id: str, prompt: list[int], sampling: Sampling
    ) -> AsyncGenerator[EngineOutput, None]:
        if self._failures:
            raise self._failures.popleft()
        answer, end_reason = synthetic_answer(prompt, sampling, self._vocab_size)
        salt = sampling.cache_salt
        root = ROOT_KEY if salt is None else salted_root(salt)
        request = SimRequest(
            request_id=request_id,
            tokens=list(prompt),
            prompt_tokens=len(prompt),
            sampling=sampling,
            answer=answer,
            end_reason=end_reason,
            keys=chain_block_keys(prompt, self._block_size, root),
            root=root,
        )
        self._requests[request_id] = request
        self._waiting.append(request)
        self._start_loop()
        finished = False
        while not finished:
            item = await request.outputs.get()
            if isinstance(item, EngineError):
                raise item
            finished = item.finished
            yield item

    async def _abort_request(self, request_id: str) -> None:
        request = self._requests.get(request_id)
        if request is not None:
            self._abort(request)

    async def _reset_prefix_cache(self) -> bool:
        """Drop every cached block; like vLLM, refused (False) while blocks are in use."""
        cleared = self._pool.clear()
        if cleared:
            self._events.append(AllBlocksCleared())
        self._publish_events()
        return cleared

    # Fault injection -------------------------------------------------------------------------

    def fail_next(self, n: int = 1, error: Exception | None = None) -> None:
        """Make the next ``n`` submissions raise ``error`` (default :class:`EngineError`)."""
        for _ in range(n):
            self._failures.append(error or EngineError("simulated engine: injected failure"))

    def stall(self) -> None:
        """Freeze the step loop (requests stay where they are) until :meth:`resume`."""
        self._unstalled.clear()

    def resume(self) -> None:
        self._unstalled.set()

    def hang(self, seconds: float) -> None:
        """Stall for ``seconds`` of wall-clock time (not scaled: it is what a test waits on).

        The timed resume ends any stall, including one started by :meth:`stall`.
        """
        self.stall()
        asyncio.get_running_loop().call_later(seconds, self.resume)

    async def die(self) -> None:
        """Crash: in-flight streams raise :class:`EngineError`, and so does every later call."""
        await self._close_with("the simulated engine died")

    # The step loop ---------------------------------------------------------------------------

    def _start_loop(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.create_task(self._step_loop(), name="simulated-engine-steps")
        self._work.set()

    async def _step_loop(self) -> None:
        try:
            await self._steps()
        except Exception as error:
            # A bug here must fail the streams loudly, not leave them waiting forever.
            logger.exception("simulated engine: step loop failed")
            self._loop_task = None
            await self._close_with(f"the simulated engine's step loop failed: {error!r}")

    async def _steps(self) -> None:
        while True:
            await self._work.wait()
            await self._unstalled.wait()
            self._drop_aborted()
            if not self._running and not self._waiting:
                self._work.clear()
                self._publish_events()
                continue
            plan = self._schedule()
            seconds = self._step_seconds(plan)
            self.simulated_time_s += seconds
            self.steps += 1
            await self._sleep(seconds * self._time_scale)
            for request, new_tokens in plan:
                self._complete_chunk(request, new_tokens)
            self._publish_events()

    async def _sleep(self, seconds: float) -> None:
        """Keep wall time in step with scaled engine time on average, not per step.

        asyncio timers fire with about a millisecond of granularity, so sleeping every
        microsecond-long scaled step would make a thousand steps last a second whatever the
        scale. Instead the loop tracks when the step should end and sleeps only while ahead of
        that deadline; a step that ends in the past just yields.
        """
        loop = asyncio.get_running_loop()
        self._deadline = max(self._deadline, loop.time()) + seconds
        ahead = self._deadline - loop.time()
        await asyncio.sleep(ahead if ahead > _TIMER_GRANULARITY_S else 0)

    def _drop_aborted(self) -> None:
        for request in [*self._running, *self._waiting]:
            if request.aborted:
                self._remove(request)

    def _schedule(self) -> list[tuple[SimRequest, int]]:
        """One step's work: (request, tokens to compute), running requests first, like vLLM."""
        budget = self._max_batched
        plan: list[tuple[SimRequest, int]] = []
        preempted = False
        for request in list(self._running):
            if budget == 0:
                break
            if request not in self._running:  # preempted to make room earlier in this loop
                continue
            new_tokens = min(len(request.tokens) - request.computed, self._chunk, budget)
            while not self._allocate(request, new_tokens):
                victim = self._running[-1]
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            else:
                plan.append((request, new_tokens))
                budget -= new_tokens
        while self._waiting and budget > 0 and not preempted and len(self._running) < self._max_seqs:
            request = self._waiting[0]
            hit_keys = self._cache_hit(request)
            computed = max(len(hit_keys) * self._block_size, self._loadable_end(request))
            new_tokens = min(len(request.tokens) - computed, self._chunk, budget)
            new_blocks = -(-(computed + new_tokens) // self._block_size) - len(hit_keys)
            if not self._pool.can_take(hit_keys, new_blocks):
                break
            self._waiting.popleft()
            request.blocks = self._pool.take_cached(hit_keys) + self._allocate_blocks(new_blocks)
            request.computed, request.registered = computed, len(hit_keys) * self._block_size
            if request.cached_tokens is None:  # first scheduled (a preempted request keeps both)
                request.cached_tokens = computed
                request.loaded_tokens = computed - request.registered
                request.scheduled_at = now()
            self._running.append(request)
            plan.append((request, new_tokens))
            budget -= new_tokens
        return plan

    @staticmethod
    def _loadable_end(request: SimRequest) -> int:
        """Where a request's document KV spans end (0 without spans): all of it is loaded."""
        spans = request.sampling.document_kv
        return spans[-1][1] if spans else 0

    def _cache_hit(self, request: SimRequest) -> list[int]:
        """Keys of the resident leading blocks, never all of the tokens (one must produce logits)."""
        usable = request.keys[: (len(request.tokens) - 1) // self._block_size]
        return usable[: self._pool.leading_cached(usable)]

    def _allocate(self, request: SimRequest, new_tokens: int) -> bool:
        needed = -(-(request.computed + new_tokens) // self._block_size) - len(request.blocks)
        if needed <= 0:
            return True
        if not self._pool.can_take((), needed):
            return False
        request.blocks += self._allocate_blocks(needed)
        return True

    def _allocate_blocks(self, count: int) -> list[int]:
        blocks, evicted = self._pool.allocate(count)
        if evicted:
            self._events.append(BlockRemoved(block_hashes=tuple(evicted)))
        return blocks

    def _preempt(self, request: SimRequest) -> None:
        """vLLM's recompute preemption: free the blocks (they stay cached), requeue at the front."""
        self._running.remove(request)
        self._pool.release(request.blocks)
        request.blocks = []
        request.computed = request.registered = 0
        self._waiting.appendleft(request)

    def _step_seconds(self, plan: Sequence[tuple[SimRequest, int]]) -> float:
        seconds = self._time.step_overhead_s
        decoding = False
        for request, new_tokens in plan:
            if request.generated and new_tokens == 1:
                decoding = True
            else:
                seconds += self._time.prefill.cost(request.computed, new_tokens)
        return seconds + (self._time.decode_step_s if decoding else 0.0)

    def _complete_chunk(self, request: SimRequest, new_tokens: int) -> None:
        """Account for a computed chunk: cache its full blocks, then sample if it reached the end."""
        request.computed += new_tokens
        self._register_full_blocks(request)
        if request.aborted or request.computed < len(request.tokens):
            return
        token, text = request.answer[request.generated]
        request.tokens.append(token)
        finished = request.generated >= len(request.answer)
        request.outputs.put_nowait(
            self._output(request, (token,), text, request.end_reason if finished else None)
        )
        if finished:
            self._remove(request)

    def _register_full_blocks(self, request: SimRequest) -> None:
        full = request.computed // self._block_size
        known = len(request.keys)
        if full > known:
            parent = request.keys[-1] if request.keys else request.root
            tail = request.tokens[known * self._block_size : full * self._block_size]
            request.keys += chain_block_keys(tail, self._block_size, parent)
        size = self._block_size
        for index in range(request.registered // size, full):
            if not self._pool.register(request.blocks[index], request.keys[index]):
                continue  # a key computed twice at once stays single
            self._events.append(
                BlockStored(
                    block_hashes=(request.keys[index],),
                    parent_block_hash=request.keys[index - 1] if index else None,
                    token_ids=tuple(request.tokens[index * size : (index + 1) * size]),
                    block_size=size,
                    cache_salt=None if index else request.sampling.cache_salt,
                )
            )
        request.registered = max(request.registered, full * size)

    def _output(
        self, request: SimRequest, token_ids: tuple[int, ...], text: str, finish_reason: str | None
    ) -> EngineOutput:
        told = finish_reason is not None and bool(request.sampling.document_kv)  # as vLLM's connector
        return EngineOutput(
            request_id=request.request_id,
            token_ids=token_ids,
            text=text,
            prompt_tokens=request.prompt_tokens,
            cached_tokens=request.cached_tokens,
            document_kv_tokens=request.loaded_tokens if told else None,
            finished=finish_reason is not None,
            finish_reason=finish_reason,
            received_at=now(),
            scheduled_at=request.scheduled_at,
        )

    def _abort(self, request: SimRequest) -> None:
        """End the stream now (as AsyncLLM's output processor does); the engine drops it next step."""
        if request.aborted or self._requests.get(request.request_id) is not request:
            return
        request.aborted = True
        request.outputs.put_nowait(self._output(request, (), "", "abort"))

    def _remove(self, request: SimRequest) -> None:
        if request in self._running:
            self._running.remove(request)
            self._pool.release(request.blocks)
            request.blocks = []
        elif request in self._waiting:
            self._waiting.remove(request)
        del self._requests[request.request_id]

    def _publish_events(self) -> None:
        events, self._events = self._events, []
        if events and self._on_kv_events is not None:
            try:
                self._on_kv_events(events)
            except Exception:
                logger.exception("simulated engine: KV-event callback failed")

    async def _shut_down(self) -> None:
        """Stop the step loop and fail every request still in the engine with the closing reason."""
        task, self._loop_task = self._loop_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        reason = self._closed_reason
        for request in self._requests.values():
            request.outputs.put_nowait(EngineError(f"engine request {request.request_id} failed: {reason}"))
        self._requests.clear()
        self._waiting.clear()
        self._running.clear()
