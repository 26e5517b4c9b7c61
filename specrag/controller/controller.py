"""The RAG controller: staged search overlapped with speculative prefill, cache-aware prompts.

Per query (RAGCache §5.3, Algorithm 2; RAGCache++ §3.6):

1. Embed the question; start the staged search; if the knowledge tree says the system prompt is
   not resident, warm it (once, in a free prefill slot).
2. After each stage, order the running top-k with the knowledge tree and build the prompt. If it
   differs from the live speculation's prompt, abort that one and, only if the prefill pool has
   room (:class:`PrefillGate`), submit the new prompt speculatively.
3. On the final stage, order and build the final prompt. If the live speculation has exactly this
   prompt, adopt its stream; otherwise abort it and submit the final prompt through the gate.
4. Stream the answer; record the timeline and what the engine served from its prefix cache.

The answer is always generated from the final retrieval result: a speculation is adopted only when
its prompt is token-for-token the final prompt, and greedy decoding makes the text identical.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field

import numpy as np

from specrag.cache.hints import HintConfig, order_hint
from specrag.cache.layout import PromptLayout
from specrag.cache.ordering import get_policy
from specrag.cache.tree import KnowledgeTree
from specrag.controller.gate import PrefillGate, Slot, default_max_prefill_bs
from specrag.controller.modes import Mode, get_mode
from specrag.controller.sessions import Session, SessionStore
from specrag.controller.timeline import Timeline
from specrag.errors import EngineError, EngineTimeoutError, InvalidInputError, OverloadedError
from specrag.pipeline.engine import Engine, EngineOutput, Sampling, check_prompt_fits, now
from specrag.pipeline.prompt import PromptBuilder
from specrag.retrieval.vector_index import VectorIndex
from specrag.service.supervisor import SupervisedEngine

logger = logging.getLogger(__name__)

# Typical prompt for the default max_prefill_bs: k passages of ~250 tokens plus the instructions.
_EXPECTED_PASSAGE_TOKENS = 250


@dataclass(frozen=True)
class ControllerConfig:
    """Controller settings; every field can be overridden per service."""

    k_default: int = 10
    k_max: int = 50
    num_stages: int = 4
    max_prefill_bs: int | None = None
    starvation_window_s: float = 2.0
    ordering_policy: str = "exact"
    order_hint: bool = True
    mode: str = "all"
    max_tokens_default: int = 64
    max_tokens_limit: int = 1024
    first_token_timeout_s: float = 60.0
    max_queue: int = 256
    batched_token_budget: int = 512

    def validate(self) -> ControllerConfig:
        get_mode(self.mode)
        get_policy(self.ordering_policy)
        if not 1 <= self.k_default <= self.k_max:
            raise InvalidInputError("k_default must be between 1 and k_max")
        if self.num_stages < 1:
            raise InvalidInputError("num_stages must be at least 1")
        if self.max_prefill_bs is not None and self.max_prefill_bs < 1:
            raise InvalidInputError("max_prefill_bs must be at least 1")
        if not 1 <= self.max_tokens_default <= self.max_tokens_limit:
            raise InvalidInputError("max_tokens_default must be between 1 and max_tokens_limit")
        if self.max_queue < 0:
            raise InvalidInputError("max_queue cannot be negative")
        if not self.first_token_timeout_s > 0:  # written so that NaN fails too
            raise InvalidInputError("first_token_timeout_s must be positive")
        if not self.starvation_window_s >= 0:
            raise InvalidInputError("starvation_window_s cannot be negative")
        return self


@dataclass(frozen=True)
class RagRequest:
    """One question. ``None`` fields take the controller's defaults."""

    question: str
    k: int | None = None
    mode: str | None = None
    max_tokens: int | None = None
    session_id: str | None = None
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)


@dataclass(frozen=True)
class AnswerDelta:
    """Newly generated text and tokens of the answer."""

    text: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class AnswerDone:
    """The end of an answer, with its full timeline and the prompt it was generated from."""

    text: str
    finish_reason: str | None
    timeline: Timeline
    prompt: PromptLayout


class _Flight:
    """One engine request, pumped into a queue by a task so its prefill runs while we search.

    The slot in the prefill pool is released at the first token, or when the request ends.
    """

    def __init__(
        self, engine: Engine, layout: PromptLayout, sampling: Sampling, slot: Slot, speculative: bool
    ):
        self.request_id = ("spec-" if speculative else "final-") + uuid.uuid4().hex
        self.layout = layout
        self.sampling = sampling
        self.submitted_at = now()
        self.first_token_at: float | None = None
        self.cached_tokens: int | None = None
        self._engine = engine
        self._slot = slot
        self._outputs: asyncio.Queue[EngineOutput | BaseException | None] = asyncio.Queue()
        self._task = asyncio.create_task(self._pump(sampling), name=self.request_id)

    async def _pump(self, sampling: Sampling) -> None:
        try:
            async for output in self._engine.generate(self.request_id, self.layout.token_ids, sampling):
                if self.first_token_at is None:
                    self.first_token_at = output.received_at
                    self.cached_tokens = output.cached_tokens
                    self._slot.release()
                self._outputs.put_nowait(output)
            self._outputs.put_nowait(None)
        except asyncio.CancelledError:
            raise
        except BaseException as error:  # handed to the consumer, who raises it in its own context
            self._outputs.put_nowait(error)
        finally:
            self._slot.release()

    async def outputs(self, first_token_timeout_s: float) -> AsyncIterator[EngineOutput]:
        """The request's outputs; the first must come within the timeout."""
        timeout: float | None = first_token_timeout_s
        while True:
            try:
                item = await asyncio.wait_for(self._outputs.get(), timeout)
            except TimeoutError:
                await self.abort()
                raise EngineTimeoutError(f"no first token within {first_token_timeout_s:.1f} s") from None
            timeout = None
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    async def abort(self) -> None:
        """Stop the request in the engine (effective after its current step) and the pump."""
        if not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._engine.abort(self.request_id)
        self._slot.release()


class RagController:
    """Answers questions with staged retrieval, speculative prefill and cache-aware ordering."""

    def __init__(
        self,
        engine: Engine,
        index: VectorIndex,
        builder: PromptBuilder,
        config: ControllerConfig | None = None,
        tree: KnowledgeTree | None = None,
        sessions: SessionStore | None = None,
    ) -> None:
        self.config = (config or ControllerConfig()).validate()
        self.engine = engine
        self.index = index
        self.builder = builder
        capacity = engine.kv_capacity_tokens
        # ``is None``, not ``or``: an empty tree or session store has length 0 and is falsy.
        if tree is None:
            tree = KnowledgeTree(
                builder.system_token_ids,
                block_size=engine.block_size,
                capacity_blocks=capacity // engine.block_size if capacity else None,
            )
        self.tree = tree
        max_bs = self.config.max_prefill_bs or default_max_prefill_bs(
            self.config.batched_token_budget,
            len(builder.system_token_ids) + self.config.k_default * _EXPECTED_PASSAGE_TOKENS,
        )
        self.gate = PrefillGate(max_bs, self.config.starvation_window_s)
        self.sessions = sessions if sessions is not None else SessionStore()
        self._hints = HintConfig(order_hint=self.config.order_hint)
        self._warming: asyncio.Task[None] | None = None
        self._in_flight: set[_Flight] = set()

    # ------------------------------------------------------------------ public

    def in_flight_request_ids(self) -> set[str]:
        """Engine requests this controller has submitted and not yet seen end (for leak checks)."""
        return {flight.request_id for flight in self._in_flight}

    async def answer(self, request: RagRequest) -> AnswerDone:
        """Run a query to the end and return the whole answer."""
        async with contextlib.aclosing(self.stream(request)) as events:
            async for event in events:
                if isinstance(event, AnswerDone):
                    return event
        raise EngineError("the answer stream ended without a result")

    async def stream(self, request: RagRequest) -> AsyncGenerator[AnswerDelta | AnswerDone, None]:
        """Answer deltas, then :class:`AnswerDone`. Closing the iterator early aborts every request."""
        k, mode, sampling, session = self.check(request)
        timeline = Timeline(arrival=now(), mode=mode.name)
        flights: list[_Flight] = []
        try:
            final = await self._retrieve_and_submit(
                request.question, k, mode, sampling, session, timeline, flights
            )
            async for event in self._stream_answer(final, timeline, session, flights):
                yield event
        finally:
            for flight in flights:
                await flight.abort()
                self._in_flight.discard(flight)

    # ------------------------------------------------------------------ steps

    def check(self, request: RagRequest) -> tuple[int, Mode, Sampling, Session | None]:
        """The request's k, mode, sampling and session, or :class:`InvalidInputError`/:class:`NotFoundError`.

        Cheap and public so that a server can check a request before admitting it: under load,
        malformed input should still get its 4xx, not a 429 for a slot it never needed.
        """
        if not isinstance(request.question, str) or not request.question.strip():
            raise InvalidInputError("the question is empty")
        try:
            request.question.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate (JSON allows "\ud800"); tokenizers reject it
            raise InvalidInputError("the question is not valid Unicode text") from None
        k = self.config.k_default if request.k is None else request.k
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= self.config.k_max:
            raise InvalidInputError(f"k must be an integer between 1 and {self.config.k_max}, got {k!r}")
        mode = get_mode(self.config.mode if request.mode is None else request.mode)
        max_tokens = self.config.max_tokens_default if request.max_tokens is None else request.max_tokens
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
            raise InvalidInputError(f"max_tokens must be an integer, got {max_tokens!r}")
        if not 1 <= max_tokens <= self.config.max_tokens_limit:
            raise InvalidInputError(f"max_tokens must be between 1 and {self.config.max_tokens_limit}")
        session = self.sessions.get(request.session_id) if request.session_id is not None else None
        self.builder.question_tokens(request.question)  # rejects over-long questions before any work
        return k, mode, Sampling(max_tokens=max_tokens), session

    def _rows(self, ids: np.ndarray) -> list[int]:
        """Corpus rows of a stage's ids in rank order; padding and repeats (synthetic rows) dropped."""
        rows: list[int] = []
        for row in self.index.passage_index_of(ids).tolist():
            if row >= 0 and row not in rows:
                rows.append(row)
        return rows

    def _prompt(
        self,
        rows: list[int],
        question: str,
        mode: Mode,
        session: Session | None,
        final: bool,
        timeline: Timeline,
    ) -> tuple[PromptLayout, int]:
        """The prompt for these documents and the tree's estimate of its cached tokens.

        Its cost is the controller's own overhead per stage, so it is timed into the timeline.
        """
        started = now()
        try:
            return self._ordered_prompt(rows, question, mode, session, final)
        finally:
            timeline.controller_s += now() - started

    def _ordered_prompt(
        self, rows: list[int], question: str, mode: Mode, session: Session | None, final: bool
    ) -> tuple[PromptLayout, int]:
        if session is not None and session.turns:
            docs, hint = rows, None
            if final:
                dedup = self.sessions.dedup(session, rows)
                docs, hint = [int(d) for d in dedup.kept], dedup.hint_text() or None
            layout = self.builder.build(docs, question, hint, history=session.history)
            return layout, len(session.history) // self.engine.block_size * self.engine.block_size
        policy = get_policy(self.config.ordering_policy if mode.ordering else "retrieval")
        ordering = policy.order(self.tree, rows)
        ordered = [int(d) for d in ordering.doc_ids]
        if session is not None and final:
            self.sessions.dedup(session, ordered)  # a first turn sends every document: remember them
        hint = order_hint(rows, ordered, self._hints) if mode.ordering else None
        return self.builder.build(ordered, question, hint), ordering.cached.tokens

    def _maybe_warm(self, mode: Mode, timeline: Timeline) -> None:
        """Warm the system prompt if the tree says it is cold, once at a time, in a free slot."""
        if not mode.warmup or self.tree.system_prompt_resident() or self._warming is not None:
            return
        slot = self.gate.try_speculate()
        if slot is None:
            return
        timeline.add("warmup_start", now())
        timeline.warmed = True
        self._warming = asyncio.create_task(self._warm(slot, timeline))

    async def _warm(self, slot: Slot, timeline: Timeline) -> None:
        tokens = self.builder.system_layout_tokens()
        try:
            result = await self.engine.warm(tokens, "warm-" + uuid.uuid4().hex)
            self.tree.record_served(self.builder.system_layout(), result.cached_tokens)
            timeline.add("warmup_done", now(), cached_tokens=result.cached_tokens)
        except Exception as error:  # warm-up is an optimisation: a failure must not fail the query
            logger.warning("system prompt warm-up failed: %s", error)
        finally:
            slot.release()
            self._warming = None

    def _launch(self, layout: PromptLayout, sampling: Sampling, slot: Slot, speculative: bool) -> _Flight:
        try:
            check_prompt_fits(len(layout.token_ids), sampling, self.engine.max_model_len)
        except InvalidInputError:
            slot.release()  # the slot was taken for a request that will never exist
            raise
        flight = _Flight(self.engine, layout, sampling, slot, speculative)
        self._in_flight.add(flight)
        return flight

    async def _retrieve_and_submit(
        self,
        question: str,
        k: int,
        mode: Mode,
        sampling: Sampling,
        session: Session | None,
        timeline: Timeline,
        flights: list[_Flight],
    ) -> _Flight:
        """Staged search with speculation; returns the flight the answer comes from."""
        loop = asyncio.get_running_loop()
        vector = await loop.run_in_executor(None, self.index.embed_query, question)
        self._maybe_warm(mode, timeline)
        timeline.search_start = now()
        stages = self.config.num_stages if mode.speculation else 1
        speculation: _Flight | None = None
        final_rows: list[int] = []
        search = self.index.search_staged(vector, k, num_stages=stages)
        async with contextlib.aclosing(search) as staged:
            async for stage in staged:
                rows = self._rows(stage.ids)
                timeline.add("stage", now(), stage=stage.stage, done=stage.done, documents=len(rows))
                if stage.done:
                    final_rows = rows
                    break
                if not mode.speculation:
                    continue
                layout, _ = self._prompt(rows, question, mode, session, False, timeline)
                if speculation is not None and speculation.layout.token_ids == layout.token_ids:
                    continue
                if speculation is not None:
                    await self._drop(speculation, timeline, flights)
                    speculation = None
                slot = self.gate.try_speculate()
                if slot is not None:
                    speculation = self._launch(layout, sampling, slot, speculative=True)
                    flights.append(speculation)
                    timeline.speculations += 1
                    timeline.add(
                        "spec_submit",
                        speculation.submitted_at,
                        stage=stage.stage,
                        request_id=speculation.request_id,
                    )
        timeline.search_end = now()
        timeline.documents = [self.builder.store.passage(row).id for row in final_rows]
        layout, predicted = self._prompt(final_rows, question, mode, session, True, timeline)
        timeline.predicted_cached_tokens = predicted
        if speculation is not None and speculation.layout.token_ids == layout.token_ids:
            timeline.adopted = True
            timeline.add("adopt", now(), request_id=speculation.request_id)
            return speculation
        if speculation is not None:
            await self._drop(speculation, timeline, flights)
        check_prompt_fits(len(layout.token_ids), sampling, self.engine.max_model_len)
        if self.gate.waiting >= self.config.max_queue:
            # Bounded queueing: past the limit a caller is told to come back instead of waiting
            # behind an unbounded line (the service answers 429 with Retry-After).
            raise OverloadedError(
                f"{self.gate.waiting} requests already wait for the engine (limit {self.config.max_queue})",
                retry_after_s=max(1.0, self.gate.waiting / self.gate.max_prefill_bs * 0.5),
            )
        queued_at = now()
        if self.gate.pool >= self.gate.max_prefill_bs or self.gate.waiting:
            timeline.add("queued", queued_at, pool=self.gate.pool, waiting=self.gate.waiting)
        slot = await self.gate.admit(predicted, len(layout.token_ids) - predicted)
        timeline.queued_s = now() - queued_at
        final = self._launch(layout, sampling, slot, speculative=False)
        flights.append(final)
        timeline.add("final_submit", final.submitted_at, request_id=final.request_id)
        return final

    async def _drop(self, flight: _Flight, timeline: Timeline, flights: list[_Flight]) -> None:
        """Abort a stale speculation and count the prefill it may have spent."""
        await flight.abort()
        flights.remove(flight)
        self._in_flight.discard(flight)
        if flight.first_token_at is not None:
            # Fully prefilled: its blocks are in the prefix cache now, the tree should know.
            self.tree.record_served(flight.layout, flight.cached_tokens)
        timeline.aborted_speculations += 1
        timeline.wasted_spec_prefill_tokens += len(flight.layout.token_ids) - (flight.cached_tokens or 0)
        timeline.add("spec_abort", now(), request_id=flight.request_id)

    async def _outputs_with_retry(
        self, flight: _Flight, timeline: Timeline, flights: list[_Flight]
    ) -> AsyncIterator[EngineOutput]:
        """The answer's outputs; a request that fails before its first token is retried once.

        RAGCache §6: a failure before the first token loses nothing the caller has seen, so the
        prompt is resubmitted (after a supervised engine has recovered, bounded in time).
        """
        retried = False
        while True:
            started = False
            try:
                async for output in flight.outputs(self.config.first_token_timeout_s):
                    started = True
                    yield output
                return
            except EngineError as error:
                if isinstance(self.engine, SupervisedEngine):
                    self.engine.report_failure(str(error))
                if started or retried:
                    raise
                retried = True
                timeline.add("retry", now(), reason=str(error))
                if isinstance(self.engine, SupervisedEngine) and not await self.engine.wait_ready(
                    self.config.first_token_timeout_s
                ):
                    raise
                slot = await self.gate.admit(0, len(flight.layout.token_ids))
                flight = self._launch(flight.layout, flight.sampling, slot, speculative=False)
                flights.append(flight)
                timeline.answer_submit = flight.submitted_at

    async def _stream_answer(
        self, flight: _Flight, timeline: Timeline, session: Session | None, flights: list[_Flight]
    ) -> AsyncIterator[AnswerDelta | AnswerDone]:
        timeline.answer_submit = flight.submitted_at
        timeline.prompt_tokens = len(flight.layout.token_ids)
        texts: list[str] = []
        tokens: list[int] = []
        finish_reason: str | None = None
        async for output in self._outputs_with_retry(flight, timeline, flights):
            if timeline.first_token is None:
                # When the caller can see it: an adopted speculation may have produced its first
                # token before the search ended, but it is only known right once the search has.
                timeline.first_token = now()
                timeline.cached_prompt_tokens = output.cached_tokens or 0
                timeline.add("first_token", timeline.first_token, cached_tokens=timeline.cached_prompt_tokens)
            texts.append(output.text)
            tokens.extend(output.token_ids)
            finish_reason = output.finish_reason or finish_reason
            if output.text or output.token_ids:
                yield AnswerDelta(output.text, output.token_ids)
        timeline.done = now()
        timeline.add("done", timeline.done)
        if session is not None:
            self.sessions.record_turn(session, flight.layout.token_ids, tokens)
        elif timeline.first_token is not None:
            self.tree.record_served(flight.layout, timeline.cached_prompt_tokens)
        yield AnswerDone("".join(texts), finish_reason, timeline, flight.layout)

    async def reset_prefix_cache(self) -> None:
        """Empty the engine's prefix cache and tell the tree at once (for cold-start experiments).

        vLLM publishes the AllBlocksCleared event only with its next step; the tree must not
        believe in cached blocks until then.
        """
        await self.engine.reset_prefix_cache()
        self.tree.engine_cache_cleared()

    async def close(self) -> None:
        """Abort every request still in flight (service shutdown)."""
        for flight in list(self._in_flight):
            await flight.abort()
        self._in_flight.clear()
        if self._warming is not None:
            self._warming.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._warming
