"""The prefill pool gate: speculation and final requests share ``max_prefill_bs`` engine slots.

The pool is the number of our requests, speculative and final, across all queries, that were
admitted to the engine and have not yet produced their first token. A slot is taken before a
request is submitted and released at its first token (or when it is aborted or fails), so the
count never lags the engine. Speculation only starts when the pool is below ``max_prefill_bs`` and
no final request is queued (RAGCache Algorithm 2); a final request that finds the pool full waits
in a queue ordered by cached/compute tokens with a starvation window (RAGCache §5.2).
"""

from __future__ import annotations

import asyncio

from specrag.cache.admission import AdmissionQueue
from specrag.errors import InvalidInputError


def default_max_prefill_bs(batched_token_budget: int, expected_prompt_tokens: int) -> int:
    """How many prompts one prefill step holds: the engine's token budget over a typical prompt.

    RAGCache sizes ``max_prefill_bs`` by what saturates the accelerator; the engine's batched-token
    budget per step is that limit as vLLM sees it.
    """
    if batched_token_budget < 1 or expected_prompt_tokens < 1:
        raise InvalidInputError("the token budget and the expected prompt length must be positive")
    return max(1, round(batched_token_budget / expected_prompt_tokens))


class Slot:
    """One request's place in the prefill pool; :meth:`release` is idempotent."""

    def __init__(self, gate: PrefillGate) -> None:
        self._gate: PrefillGate | None = gate

    @property
    def held(self) -> bool:
        return self._gate is not None

    def release(self) -> None:
        gate, self._gate = self._gate, None
        if gate is not None:
            gate._give_back()


class PrefillGate:
    """Counts the prefill pool and admits final requests by cache-aware priority."""

    def __init__(self, max_prefill_bs: int, starvation_window_s: float) -> None:
        if max_prefill_bs < 1:
            raise InvalidInputError(f"max_prefill_bs must be at least 1, got {max_prefill_bs}")
        self.max_prefill_bs = max_prefill_bs
        self._queue: AdmissionQueue[asyncio.Future[Slot]] = AdmissionQueue(starvation_window_s)
        self._pool = 0
        self.peak_pool = 0

    @property
    def pool(self) -> int:
        """Requests admitted to the engine that have not produced their first token."""
        return self._pool

    @property
    def waiting(self) -> int:
        """Final requests queued for a slot."""
        return len(self._queue)

    def try_speculate(self) -> Slot | None:
        """A slot for a speculative request, or None: speculation never queues, never cuts in line."""
        if self._pool >= self.max_prefill_bs or self._queue:
            return None
        return self._take()

    async def admit(self, cached_tokens: int, compute_tokens: int) -> Slot:
        """A slot for a final request, waiting by priority (cached / compute) if the pool is full."""
        if not self._queue and self._pool < self.max_prefill_bs:
            return self._take()
        waiter: asyncio.Future[Slot] = asyncio.get_running_loop().create_future()
        self._queue.push(waiter, cached_tokens, compute_tokens)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                waiter.result().release()  # granted just as we were cancelled: hand it on
            else:
                waiter.cancel()
            raise

    def _take(self) -> Slot:
        self._pool += 1
        self.peak_pool = max(self.peak_pool, self._pool)
        return Slot(self)

    def _give_back(self) -> None:
        self._pool -= 1
        while self._queue and self._pool < self.max_prefill_bs:
            waiter = self._queue.pop()
            if not waiter.done():  # a cancelled waiter's future is already done
                waiter.set_result(self._take())
