"""The one async interface every engine adapter implements, and the bookkeeping they share.

The controller speaks only this protocol, so the in-process vLLM engine, an OpenAI-compatible
server over HTTP and the simulated engine are interchangeable. Prompts are token IDs (never text:
re-tokenizing a concatenation breaks prefix-cache blocks). The protocol exposes what the
speculation rule needs: when the first token arrived, how many prompt tokens the prefix cache
served and an abort that works mid-prefill. It also reports how many of our requests wait for
their first token (:meth:`Engine.load`); the speculation gate does not read that, it counts the
prefill pool itself (``specrag.controller.gate``), so the two can be checked against each other.

The adapters share their request bookkeeping through
:class:`~specrag.pipeline.engines.base.EngineBase`: the base validates and tracks requests, each
adapter only talks to its engine.

Supervision is an optional capability, asked for through :attr:`Engine.supervision` rather than by
the engine's class: an engine that something keeps alive (the supervisor beside the adapters) returns its
:class:`Supervision`; a bare adapter returns None.
"""

from __future__ import annotations

import hashlib
import math
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from specrag.errors import InvalidInputError

__all__ = [
    "MAX_PENALTY",
    "TURBO_CACHE_SALT_PREFIX",
    "Engine",
    "EngineCounts",
    "EngineLoad",
    "EngineOutput",
    "EngineShape",
    "EngineState",
    "Sampling",
    "Supervision",
    "SupervisionStatus",
    "WarmResult",
    "latest_cached_tokens",
    "now",
]


#: OpenAI's bound on ``frequency_penalty`` and ``presence_penalty`` (either sign).
MAX_PENALTY = 2.0

#: What every document-KV request's prefix-cache salt starts with (:attr:`Sampling.cache_salt`).
TURBO_CACHE_SALT_PREFIX = "specrag-turbo-"


@dataclass(frozen=True)
class Sampling:
    """Decoding settings. Greedy by default so the same prompt gives the same answer."""

    max_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    """Strings that end the answer; the text stops before the first one (finish reason "stop")."""
    frequency_penalty: float = 0.0
    """OpenAI's: subtracted from a token's logit once for every time the answer already holds it."""
    presence_penalty: float = 0.0
    """OpenAI's: subtracted from a token's logit once the answer holds it at all."""
    repetition_penalty: float = 1.0
    """vLLM's (CTRL's): divides a positive logit, multiplies a negative one, of every token the
    prompt or the answer holds; 1 is none. Only an engine that :attr:`Engine.honours_penalties`
    takes a penalty other than neutral."""
    ignore_eos: bool = False
    document_kv: tuple[tuple[int, int], ...] = ()
    """Prompt spans ``[start, end)`` (documents, in order) whose KV the engine may load from its
    document KV store instead of prefilling them (TurboRAG); empty: a full prefill. Only an engine
    started with a document KV store accepts it (:attr:`EngineConfig.document_kv_dir`)."""
    document_kv_prefix: int = 0
    """The documents' stored KV was computed after the prompt's first ``document_kv_prefix`` tokens
    (the system prompt: APE's shared prefix), not alone from position 0; 0: alone. The prefix is
    the first span, stored alone (it starts the prompt either way)."""

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise InvalidInputError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise InvalidInputError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidInputError(f"top_p must be in (0, 1], got {self.top_p}")
        if not all(self.stop):
            raise InvalidInputError("a stop string cannot be empty")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise InvalidInputError(f"{name} must be between -2 and 2, got {getattr(self, name)}")
        if not 0 < self.repetition_penalty < math.inf:
            raise InvalidInputError(f"repetition_penalty must be above 0, got {self.repetition_penalty}")
        end = 0
        for start, stop in self.document_kv:
            if not end <= start < stop:
                raise InvalidInputError(
                    f"document_kv spans must be ordered and non-empty, got {self.document_kv}"
                )
            end = stop
        if self.document_kv_prefix and (self.document_kv or ((-1, -1),))[0] != (0, self.document_kv_prefix):
            raise InvalidInputError(
                f"document_kv_prefix {self.document_kv_prefix} must be the first span of {self.document_kv}, "
                "starting at 0"
            )

    @property
    def penalties(self) -> tuple[str, ...]:
        """The names of the penalties set to something other than neutral (none: an empty tuple)."""
        neutral = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0}
        return tuple(name for name, value in neutral.items() if getattr(self, name) != value)

    @property
    def cache_salt(self) -> str | None:
        """The prefix-cache salt of a request that loads document KV; None for a full prefill.

        Loaded blocks only approximate a full prefill, and what a block holds depends on which spans
        were loaded (a document loaded, or prefilled fresh after loaded ones) and how they were
        computed (alone, or after the prefix): the salt names exactly that, so a block is reused
        only by a request that would have computed the same KV, and never by a full prefill.
        """
        if not self.document_kv:
            return None
        spans = ",".join(f"{start}-{stop}" for start, stop in self.document_kv)
        digest = hashlib.sha256(f"{spans};prefix={self.document_kv_prefix}".encode()).hexdigest()[:16]
        return f"{TURBO_CACHE_SALT_PREFIX}{digest}"


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
    every engine fulfils (the adapters through :class:`~specrag.pipeline.engines.base.EngineBase`,
    the supervisor by wrapping one)."""

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
    def honours_penalties(self) -> bool:
        """Whether the engine applies :attr:`Sampling.penalties` (vLLM does; a simulated engine
        cannot: its tokens come from no logits)."""
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
