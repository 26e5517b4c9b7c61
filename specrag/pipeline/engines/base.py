"""What every engine adapter does the same way: validation, request tracking, warm-up, closing.

The adapters share this bookkeeping (as vLLM v1's engine-core clients share one abstract base):
:class:`EngineBase` validates and tracks requests, each adapter only talks to its engine. The
contract itself, and the values it speaks in, are in :mod:`specrag.pipeline.engines.protocol`.
"""

from __future__ import annotations

import asyncio
import contextlib
from abc import abstractmethod
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field

from specrag.errors import EngineError, InvalidInputError
from specrag.pipeline.engines.protocol import (
    Engine,
    EngineCounts,
    EngineLoad,
    EngineOutput,
    EngineShape,
    Sampling,
    Supervision,
    WarmResult,
    latest_cached_tokens,
    now,
)

__all__ = [
    "RESET_RETRY_S",
    "RESET_TIMEOUT_S",
    "DescribedEngine",
    "EngineBase",
    "RequestTracker",
    "check_document_kv",
    "check_penalties",
    "check_prompt_fits",
    "prompt_fits",
    "warm_by_prefill",
]

RESET_TIMEOUT_S = 30.0
"""How long a prefix-cache reset waits for the requests holding blocks to end."""
RESET_RETRY_S = 0.05


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
        prompt = list(map(int, prompt_token_ids))  # a numpy array's too; map is twice as fast
        check_prompt_fits(len(prompt), sampling, self.max_model_len)
        check_document_kv(len(prompt), sampling, self.supports_document_kv)
        check_penalties(sampling, self.honours_penalties)
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


def prompt_fits(prompt_tokens: int, sampling: Sampling, max_model_len: int) -> bool:
    """Whether a prompt and its answer fit the model's context: the one rule, whether a caller
    is refused (:func:`check_prompt_fits`) or a speculation is skipped."""
    return prompt_tokens + sampling.max_tokens <= max_model_len


def check_prompt_fits(prompt_tokens: int, sampling: Sampling, max_model_len: int) -> None:
    """Reject a prompt the engine would refuse, before it costs anything, with the numbers in the message."""
    if prompt_tokens == 0:
        raise InvalidInputError("the prompt is empty")
    if not prompt_fits(prompt_tokens, sampling, max_model_len):
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


def check_penalties(sampling: Sampling, honoured: bool) -> None:
    """Reject penalties an engine would not apply, naming them: an answer decoded without the
    penalty asked for would be silently another answer."""
    if sampling.penalties and not honoured:
        raise InvalidInputError(f"{', '.join(sampling.penalties)}: not supported by this engine")


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
