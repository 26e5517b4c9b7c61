"""The one async interface every engine adapter implements, and the bookkeeping they share.

The controller speaks only this protocol, so the in-process vLLM engine, an OpenAI-compatible
server over HTTP and the simulated engine are interchangeable. Prompts are token IDs (never text:
re-tokenizing a concatenation breaks prefix-cache blocks). The protocol exposes what the
speculation rule needs: when the first token arrived, how many prompt tokens the prefix cache
served and an abort that works mid-prefill. It also reports how many of our requests wait for
their first token (:meth:`Engine.load`); the speculation gate does not read that, it counts the
prefill pool itself (``specrag.controller.gate``), so the two can be checked against each other.

The adapters share their request bookkeeping through :class:`EngineBase` (as vLLM v1's engine-core
clients share one abstract base): the base validates and tracks requests, each adapter only
talks to its engine.

Supervision is an optional capability, asked for through :attr:`Engine.supervision` rather than by
the engine's class: an engine that something keeps alive (the service's supervisor) returns its
:class:`Supervision`; a bare adapter returns None.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from specrag.errors import EngineError, InvalidInputError

RESET_TIMEOUT_S = 30.0
"""How long a prefix-cache reset waits for the requests holding blocks to end."""
RESET_RETRY_S = 0.05


@dataclass(frozen=True)
class Sampling:
    """Decoding settings. Greedy by default so the same prompt gives the same answer."""

    max_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    """Strings that end the answer; the text stops before the first one (finish reason "stop")."""
    ignore_eos: bool = False
    document_kv: tuple[tuple[int, int], ...] = ()
    """Prompt spans ``[start, end)`` (documents, in order) whose KV the engine may load from its
    document KV store instead of prefilling them (TurboRAG); empty: a full prefill. Only an engine
    started with a document KV store accepts it (:attr:`EngineConfig.document_kv_dir`)."""

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise InvalidInputError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise InvalidInputError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidInputError(f"top_p must be in (0, 1], got {self.top_p}")
        if not all(self.stop):
            raise InvalidInputError("a stop string cannot be empty")
        end = 0
        for start, stop in self.document_kv:
            if not end <= start < stop:
                raise InvalidInputError(
                    f"document_kv spans must be ordered and non-empty, got {self.document_kv}"
                )
            end = stop


@dataclass(frozen=True)
class EngineOutput:
    """One streamed increment of a request's output.

    ``cached_tokens`` is the number of prompt tokens the engine's prefix cache served (vLLM's
    ``num_cached_tokens``), or None while the engine has not reported it. Every adapter reports it
    on the finishing output at the latest (when the engine reports it at all) and on every output
    after the first that carries it; the in-process engine knows it from the first increment on,
    an OpenAI server only in its final usage chunk. Read the latest non-None value (see
    :func:`latest_cached_tokens`). ``received_at`` is the
    ``time.perf_counter()`` at which the adapter received the increment. ``scheduled_at`` is when
    the engine's scheduler first gave the request a step (its prefill began), on the same clock,
    when the engine reports it (vLLM's per-request statistics do); None when it does not, and a
    figure built on it must then say it used the submission time instead. ``queued_at`` (the
    engine took the request into its queue) and ``emitted_at`` (the engine produced this
    increment, before it crossed to us) are the engine's own stamps on the same clock, when it
    reports them: with ``scheduled_at`` and ``received_at`` they split a first token's latency
    into hand-over, queue, compute and delivery (:meth:`Timeline.phases
    <specrag.controller.timeline.Timeline.phases>`). ``document_kv_tokens``: of the cached
    tokens, those loaded from the document KV store (TurboRAG), reported with the finishing
    output by an engine that has a store; None otherwise.
    """

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    prompt_tokens: int
    cached_tokens: int | None
    finished: bool
    finish_reason: str | None
    received_at: float
    scheduled_at: float | None = None
    document_kv_tokens: int | None = None
    queued_at: float | None = None
    emitted_at: float | None = None


@dataclass(frozen=True)
class EngineShape:
    """What an engine says about itself once, when started or connected (the contract's
    :attr:`Engine.block_size`, :attr:`Engine.max_model_len` and :attr:`Engine.kv_capacity_tokens`)."""

    block_size: int
    max_model_len: int
    kv_capacity_tokens: int | None


@dataclass(frozen=True)
class WarmResult:
    """Outcome of warming a prefix: how much of it the engine already held."""

    prompt_tokens: int
    cached_tokens: int
    block_size: int
    elapsed_s: float

    @property
    def was_cached(self) -> bool:
        """True when every full block of the prefix was already in the prefix cache.

        vLLM always recomputes the last block of an exact repeat, so "fully cached" means all
        blocks but that one.
        """
        full_blocks = self.prompt_tokens // self.block_size
        needed = max(full_blocks - 1, 0) * self.block_size
        return self.cached_tokens >= needed


@dataclass(frozen=True)
class EngineLoad:
    """Requests of ours in the engine: waiting for their first token, or decoding.

    ``engine_waiting`` is the engine's own count of requests (anyone's) waiting to be scheduled,
    as it last reported it without I/O (0 when it reports nothing that way): the prefill gate
    holds speculation back while the engine has a backlog.
    """

    prefilling: int
    decoding: int
    engine_waiting: int = 0


@dataclass(frozen=True)
class EngineCounts:
    """The engine's own view of its queues, for leak checks (not our bookkeeping)."""

    running: int
    waiting: int
    unfinished: int


EngineState = Literal["starting", "ready", "recovering", "down", "stopping", "failed"]
"""``recovering``: replacing a failed engine; ``down``: a replacement failed and is retried with
backoff; ``stopping``: the service is shutting down; ``failed``: closed or given up on."""


@dataclass(frozen=True)
class SupervisionStatus:
    """What a supervisor says about its engine, for health checks."""

    state: EngineState
    restarts: int
    last_recovery_s: float | None


class Supervision(Protocol):
    """Something that notices a failed engine and replaces it, and that callers may ask for help.

    A query that saw the engine fail in a way the engine cannot see itself (no first token in
    time) reports it; before retrying, it waits (bounded) for the recovery to finish.
    """

    def status(self) -> SupervisionStatus:
        """The engine's state, restart count and last recovery time."""
        ...

    def report_failure(self, reason: str) -> None:
        """A caller saw the engine fail: check it, and replace it if it does not answer."""
        ...

    async def wait_ready(self, timeout_s: float) -> bool:
        """Wait (bounded) for a recovery in progress; True when an engine is in service."""
        ...


class Engine(ABC):
    """An inference engine with automatic prefix caching, driven by token IDs: the one contract
    every engine fulfils (the adapters through :class:`EngineBase`, the service's supervisor by
    wrapping one)."""

    @property
    @abstractmethod
    def block_size(self) -> int:
        """KV-cache block size in tokens: the granularity of prefix-cache hits."""
        ...

    @property
    @abstractmethod
    def max_model_len(self) -> int:
        """Longest prompt + completion the engine accepts, in tokens."""
        ...

    @property
    @abstractmethod
    def kv_capacity_tokens(self) -> int | None:
        """Tokens the KV cache holds, when the engine reports it."""
        ...

    @property
    def supports_document_kv(self) -> bool:
        """Whether requests may load documents' KV from a store (:attr:`Sampling.document_kv`)."""
        return False

    @property
    @abstractmethod
    def supervision(self) -> Supervision | None:
        """The supervisor that keeps this engine alive, or None for an engine nobody restarts."""
        ...

    @abstractmethod
    def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], sampling: Sampling
    ) -> AsyncIterator[EngineOutput]:
        """Submit a prompt and stream its output. Leaving the iteration early aborts the request."""
        ...

    @abstractmethod
    async def abort(self, request_id: str) -> None:
        """Abort a request; it stops after the engine's current step. Unknown ids are ignored."""
        ...

    @abstractmethod
    async def warm(self, prompt_token_ids: Sequence[int], request_id: str) -> WarmResult:
        """Prefill a prefix (one output token) so later prompts starting with it hit the cache."""
        ...

    @abstractmethod
    def load(self) -> EngineLoad:
        """Our requests in the engine, split by whether their first token has arrived."""
        ...

    @abstractmethod
    async def counts(self) -> EngineCounts:
        """The engine's own running/waiting counts."""
        ...

    @property
    @abstractmethod
    def batched_token_budget(self) -> int | None:
        """Prompt tokens the engine computes in one step (vLLM's ``max_num_batched_tokens``), when known."""
        ...

    @abstractmethod
    def known_failure(self) -> str | None:
        """Why the engine has failed, when it knows without a request failing (else None).

        The pool's health check excludes a replica on it at once, instead of waiting for the
        engine's requests to fail (vLLM fails them only after shutting a dead engine down).
        """
        ...

    @abstractmethod
    async def reset_prefix_cache(self) -> None:
        """Drop everything in the prefix cache (for cold-start experiments).

        Returns only once the engine confirmed the reset; raises :class:`EngineError` otherwise
        (vLLM refuses a reset while requests hold blocks).
        """
        ...

    @abstractmethod
    async def close(self) -> None:
        """Stop the engine and release its resources. Idempotent."""
        ...


@dataclass
class RequestTracker:
    """Which of our requests wait for their first token, which decode.

    Counted on our side, not scraped from the engine's metrics, so it is exact at every moment:
    what tests, leak checks and :meth:`Engine.load` rely on.
    """

    _prefilling: set[str] = field(default_factory=set)
    _decoding: set[str] = field(default_factory=set)

    def submitted(self, request_id: str) -> None:
        if request_id in self._prefilling or request_id in self._decoding:
            raise InvalidInputError(f"request id {request_id!r} is already in flight")
        self._prefilling.add(request_id)

    def first_token(self, request_id: str) -> None:
        if request_id in self._prefilling:
            self._prefilling.discard(request_id)
            self._decoding.add(request_id)

    def finished(self, request_id: str) -> None:
        self._prefilling.discard(request_id)
        self._decoding.discard(request_id)

    def load(self, engine_waiting: int = 0) -> EngineLoad:
        return EngineLoad(len(self._prefilling), len(self._decoding), engine_waiting)


class EngineBase(Engine):
    """What every adapter does the same way: validation, request tracking, warm-up, closing.

    :meth:`generate` checks the prompt, tracks the request from submission through its first
    token to its end, and aborts it in the engine when the caller leaves before it finished
    (cancel, break, error), so no work is left behind. An adapter implements only what talks to
    its engine: :meth:`_stream` (submit one request, stream its outputs), :meth:`_abort_request`,
    :meth:`_counts`, :meth:`_reset_prefix_cache` and :meth:`_shut_down`.
    """

    def __init__(self) -> None:
        self._tracker = RequestTracker()
        self._closed_reason: str | None = None

    @property
    def supervision(self) -> Supervision | None:
        return None  # nothing restarts a bare adapter by itself

    @property
    def batched_token_budget(self) -> int | None:
        return None  # an adapter whose engine reports its step budget says so

    @property
    def closed(self) -> bool:
        return self._closed_reason is not None

    def known_failure(self) -> str | None:
        return None  # an adapter whose engine can tell it is dead says so

    def load(self) -> EngineLoad:
        return self._tracker.load(self._engine_waiting())

    def _engine_waiting(self) -> int:
        """The engine's own waiting count, when known without I/O (an adapter that knows it says)."""
        return 0

    async def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], sampling: Sampling
    ) -> AsyncIterator[EngineOutput]:
        self._ensure_open()
        prompt = [int(token) for token in prompt_token_ids]
        check_prompt_fits(len(prompt), sampling, self.max_model_len)
        check_document_kv(len(prompt), sampling, self.supports_document_kv)
        self._tracker.submitted(request_id)
        finished = False
        try:
            async with contextlib.aclosing(self._stream(request_id, prompt, sampling)) as outputs:
                async for output in outputs:
                    self._tracker.first_token(request_id)
                    finished = output.finished
                    yield output
        finally:
            self._tracker.finished(request_id)
            if not finished:
                await self._abort_request(request_id)

    async def abort(self, request_id: str) -> None:
        try:
            await self._abort_request(request_id)
        finally:
            self._tracker.finished(request_id)

    async def warm(self, prompt_token_ids: Sequence[int], request_id: str) -> WarmResult:
        return await warm_by_prefill(self, prompt_token_ids, request_id)

    async def counts(self) -> EngineCounts:
        self._ensure_open()
        return await self._counts()

    async def reset_prefix_cache(self) -> None:
        """Reset, retrying while requests still hold blocks; :class:`EngineError` if it never happens.

        vLLM refuses a reset (and says so only in its result) while any block is in use: the
        requests just aborted may still be finishing their step. A reset that was refused must
        not be reported as done, or every "cold start" figure after it would be warm.
        """
        self._ensure_open()
        deadline = now() + RESET_TIMEOUT_S
        while not await self._reset_prefix_cache():
            if now() >= deadline:
                counts = await self._counts()
                raise EngineError(
                    f"the engine refused to reset its prefix cache for {RESET_TIMEOUT_S:.0f} s: "
                    f"{counts.unfinished} requests still hold blocks"
                )
            await asyncio.sleep(RESET_RETRY_S)  # wait for the engine to go idle, then ask again

    async def close(self) -> None:
        if not self.closed:
            await self._close_with("the engine is closed")

    async def _close_with(self, reason: str) -> None:
        """Refuse every later call with ``reason``, then shut the engine down."""
        self._closed_reason = reason
        await self._shut_down()

    def _ensure_open(self) -> None:
        if self._closed_reason is not None:
            raise EngineError(self._closed_reason)

    @abstractmethod
    def _stream(
        self, request_id: str, prompt: list[int], sampling: Sampling
    ) -> AsyncGenerator[EngineOutput, None]:
        """Submit one checked, tracked request and stream its outputs until the finishing one."""

    @abstractmethod
    async def _abort_request(self, request_id: str) -> None:
        """Stop the request in the engine (after its current step); unknown ids are ignored."""

    @abstractmethod
    async def _counts(self) -> EngineCounts:
        """The engine's own running/waiting counts (the engine is open)."""

    @abstractmethod
    async def _reset_prefix_cache(self) -> bool:
        """Drop the prefix cache (the engine is open); False when the engine refused (blocks in use)."""

    @abstractmethod
    async def _shut_down(self) -> None:
        """Release the engine, once; requests still streaming must end with :class:`EngineError`."""


def check_prompt_fits(prompt_tokens: int, sampling: Sampling, max_model_len: int) -> None:
    """Reject a prompt the engine would refuse, before it costs anything, with the numbers in the message."""
    if prompt_tokens == 0:
        raise InvalidInputError("the prompt is empty")
    if prompt_tokens + sampling.max_tokens > max_model_len:
        raise InvalidInputError(
            f"prompt of {prompt_tokens} tokens + max_tokens {sampling.max_tokens} exceeds the model's "
            f"limit of {max_model_len} tokens"
        )


def check_document_kv(prompt_tokens: int, sampling: Sampling, supported: bool) -> None:
    """Reject document spans an engine cannot load or that leave no prompt token to compute."""
    if not sampling.document_kv:
        return
    if not supported:
        raise InvalidInputError("this engine has no document KV store (start it with --document-kv turbo)")
    if sampling.document_kv[-1][1] >= prompt_tokens:
        raise InvalidInputError(
            f"document_kv spans end at {sampling.document_kv[-1][1]}: they must leave at least the last "
            f"of the prompt's {prompt_tokens} tokens to compute"
        )


async def warm_by_prefill(engine: Engine, prompt_token_ids: Sequence[int], request_id: str) -> WarmResult:
    """Warm a prefix the way every APC engine allows: prefill it, generate one token, report the hit."""
    started = now()
    cached: int | None = None
    async for output in engine.generate(request_id, prompt_token_ids, Sampling(max_tokens=1)):
        cached = latest_cached_tokens(output, cached)
    return WarmResult(
        prompt_tokens=len(prompt_token_ids),
        cached_tokens=cached or 0,
        block_size=engine.block_size,
        elapsed_s=now() - started,
    )


def latest_cached_tokens(output: EngineOutput, known: int | None) -> int | None:
    """The request's cached-token count after ``output``: its own when reported, else ``known``."""
    return known if output.cached_tokens is None else output.cached_tokens


# What now() reads. Only a simulation in virtual time replaces it, for its run
# (specrag.sim.virtual_time.clock); the product never does.
_clock: Callable[[], float] = time.perf_counter


def now() -> float:
    """The clock every timeline uses (monotonic, sub-microsecond; a simulation's virtual time
    while one runs)."""
    return _clock()


class DescribedEngine(EngineBase):
    """An adapter whose engine described itself once (a server when connected, a Ray replica when
    started): the shape properties read that description, ``_info``."""

    _info: EngineShape

    @property
    def block_size(self) -> int:
        return self._info.block_size

    @property
    def max_model_len(self) -> int:
        return self._info.max_model_len

    @property
    def kv_capacity_tokens(self) -> int | None:
        return self._info.kv_capacity_tokens
