"""The prefill pool gate: speculation and final requests share ``max_prefill_bs`` engine slots.

The pool is the number of our requests, speculative and final, across all queries, that were
admitted to the engine and have not yet produced their first token. A slot is taken before a
request is submitted and released at its first token (or when it is aborted or fails), so the
count never lags the engine. A final request that finds the pool full waits in a queue ordered by
cached/compute tokens with a starvation window (RAGCache §5.2), or, with the window order
(``ControllerConfig.prefill_order = "window"``, one engine), by a :class:`WindowScheduler`, which
chooses among the oldest waiting requests the next one *and* its document order against the tree
at the moment a slot frees (the slot carries that order; the run rebuilds its prompt with it).

Speculation uses only idle capacity, so that it can never make another query's answer wait
longer than it would without speculation (the tail must be no worse than serial):

- it starts only when the pool has room, no final request of ours is queued (RAGCache
  Algorithm 2) and the engine itself reports no waiting request (another client's, or a
  warm-up);
- the uncomputed prompt tokens of all speculations before their first token stay within a
  budget (HedraRAG's global speculation budget), by default one engine step of each replica's
  ``max_num_batched_tokens``: one speculation may always run, more only while their work fits
  the steps the engine would otherwise leave empty;
- a final request that finds the pool full *preempts* the newest speculation still prefilling:
  its slot passes to the final request at once and the speculation is aborted (vLLM stops it
  after its current step), so a final request waits at most one engine step behind speculative
  work instead of a whole speculative prefill.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from specrag.cache.layout import DocId
from specrag.cache.ordering import Ordering
from specrag.cache.prefill_queue import RatioQueue, WindowScheduler
from specrag.cache.tree import KnowledgeTree
from specrag.errors import EngineTimeoutError, InvalidInputError

__all__ = ["OrderingWindow", "PrefillGate", "Slot", "default_max_prefill_bs"]


def default_max_prefill_bs(batched_token_budget: int, expected_prompt_tokens: int) -> int:
    """How many prompts one prefill step holds: the engine's token budget over a typical prompt.

    RAGCache sizes ``max_prefill_bs`` by what saturates the accelerator; the engine's batched-token
    budget per step is that limit as vLLM sees it.
    """
    if batched_token_budget < 1 or expected_prompt_tokens < 1:
        raise InvalidInputError("the token budget and the expected prompt length must be positive")
    return max(1, round(batched_token_budget / expected_prompt_tokens))


class Slot:
    """One request's place in the prefill pool; :meth:`release` is idempotent.

    A speculative slot carries the prompt tokens its request still has to compute (what it
    charges to the speculation budget) and how to preempt it.
    """

    def __init__(
        self, gate: PrefillGate, speculative_tokens: int = 0, preempt: Callable[[], None] | None = None
    ) -> None:
        self._gate: PrefillGate | None = gate
        self.speculative_tokens = speculative_tokens
        self._preempt = preempt
        # The document order a window scheduler chose for this request when it admitted it.
        self.ordering: Ordering | None = None

    @property
    def held(self) -> bool:
        return self._gate is not None

    @property
    def preemptible(self) -> bool:
        return self._gate is not None and self._preempt is not None

    def release(self) -> None:
        gate, self._gate = self._gate, None
        if gate is not None:
            gate._give_back(self)

    def adopt(self) -> None:
        """The speculation became its query's answer: from now on it is final work, never preempted."""
        self._preempt = None
        if self._gate is not None:
            self._gate._no_longer_speculative(self)

    def preempt(self) -> None:
        """Give the slot back now and tell the owner to abort its request (it must not block)."""
        preempt, self._preempt = self._preempt, None
        self.release()
        if preempt is not None:
            preempt()


@dataclass(frozen=True)
class OrderingWindow:
    """What the window order needs: the tree (of the one engine) waiting requests are ordered
    against, and how many of the oldest are compared."""

    tree: KnowledgeTree
    window_requests: int


class PrefillGate:
    """Counts the prefill pool, budgets speculation and admits final requests by cache-aware priority."""

    def __init__(
        self,
        max_prefill_bs: int,
        starvation_window_s: float,
        speculative_token_budget: int | None = None,
        window: OrderingWindow | None = None,
        max_wait_s: float | None = None,
    ) -> None:
        if max_prefill_bs < 1:
            raise InvalidInputError(f"max_prefill_bs must be at least 1, got {max_prefill_bs}")
        if speculative_token_budget is not None and speculative_token_budget < 1:
            raise InvalidInputError(
                f"speculative_token_budget must be at least 1, got {speculative_token_budget}"
            )
        self.max_prefill_bs = max_prefill_bs
        self.speculative_token_budget = speculative_token_budget
        # A final request's wait for a slot is bounded: should a slot ever not come back, callers
        # get an error naming the pool instead of waiting for their clients to give up.
        self.max_wait_s = max_wait_s
        self._queue: RatioQueue[asyncio.Future[Slot]] | WindowScheduler[asyncio.Future[Slot]]
        self._window_tree = window.tree if window is not None else None
        if window is None:
            self._queue = RatioQueue(starvation_window_s)
        else:
            self._queue = WindowScheduler(starvation_window_s, window_requests=window.window_requests)
        self._pool = 0
        self._speculative: list[Slot] = []  # held speculative slots, oldest first
        self.peak_pool = 0
        self.preemptions = 0

    @property
    def pool(self) -> int:
        """Requests admitted to the engine that have not produced their first token."""
        return self._pool

    @property
    def waiting(self) -> int:
        """Final requests queued for a slot."""
        return len(self._queue)

    @property
    def speculative_tokens(self) -> int:
        """Prompt tokens the speculations before their first token still have to compute."""
        return sum(slot.speculative_tokens for slot in self._speculative)

    def try_speculate(
        self, compute_tokens: int = 0, engine_waiting: int = 0, preempt: Callable[[], None] | None = None
    ) -> Slot | None:
        """A slot for a speculative request, or None: speculation never queues, never cuts in line.

        ``compute_tokens`` is what the prompt would compute (charged to the budget),
        ``engine_waiting`` the requests the engine itself reports waiting, and ``preempt`` how
        a final request that needs the slot stops this speculation (None: it cannot be).
        """
        if self._pool >= self.max_prefill_bs or self._queue or engine_waiting > 0:
            return None
        budget = self.speculative_token_budget
        if budget is not None and self._speculative and self.speculative_tokens + compute_tokens > budget:
            return None
        slot = self._take(compute_tokens, preempt)
        self._speculative.append(slot)
        return slot

    async def admit(self, cached_tokens: int, compute_tokens: int, documents: Sequence[DocId] = ()) -> Slot:
        """A slot for a final request, waiting by priority (cached / compute) if the pool is full.

        A full pool first gives up its newest preemptible speculation. ``documents`` (retrieval
        rank) let the window order choose the request's document order: the slot's ``ordering``.
        """
        if not self._queue and self._pool < self.max_prefill_bs:
            return self._take()
        waiter: asyncio.Future[Slot] = asyncio.get_running_loop().create_future()
        if isinstance(self._queue, WindowScheduler):
            self._queue.push(waiter, documents, cached_tokens + compute_tokens)
        else:
            self._queue.push(waiter, cached_tokens, compute_tokens)
        self._preempt_for_waiters()
        try:
            async with asyncio.timeout(self.max_wait_s):
                return await self._granted(waiter)
        except TimeoutError:
            raise EngineTimeoutError(
                f"no prefill slot within {self.max_wait_s:.1f} s: the pool of {self.max_prefill_bs} is "
                f"full and {len(self._queue)} other requests wait"
            ) from None

    async def _granted(self, waiter: asyncio.Future[Slot]) -> Slot:
        """The slot ``waiter`` is granted; a caller that stops waiting leaves the queue."""
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                waiter.result().release()  # granted just as we were cancelled: hand it on
            else:
                waiter.cancel()
                # Counted as waiting it would turn callers away (max_queue); in the window, its
                # documents would steer the others' order.
                self._queue.remove(waiter)
            raise

    def _preempt_for_waiters(self) -> None:
        """Preempt speculations, newest first, while final requests wait for a full pool."""
        while len(self._queue) and self._pool >= self.max_prefill_bs:
            victim = next((slot for slot in reversed(self._speculative) if slot.preemptible), None)
            if victim is None:
                return
            self.preemptions += 1
            victim.preempt()  # releases the slot, which wakes the best waiter

    def _take(self, speculative_tokens: int = 0, preempt: Callable[[], None] | None = None) -> Slot:
        self._pool += 1
        self.peak_pool = max(self.peak_pool, self._pool)
        return Slot(self, speculative_tokens, preempt)

    def _no_longer_speculative(self, slot: Slot) -> None:
        if slot in self._speculative:
            self._speculative.remove(slot)

    def _give_back(self, slot: Slot) -> None:
        self._pool -= 1
        self._no_longer_speculative(slot)
        while self._queue and self._pool < self.max_prefill_bs:
            ordering: Ordering | None = None
            if isinstance(self._queue, WindowScheduler):
                assert self._window_tree is not None
                waiter, ordering = self._queue.pop(self._window_tree)
            else:
                waiter = self._queue.pop()
            if not waiter.done():  # a cancelled waiter's future is already done
                granted = self._take()
                if ordering is not None and ordering.doc_ids:  # none without documents (a session's turn)
                    granted.ordering = ordering
                waiter.set_result(granted)
