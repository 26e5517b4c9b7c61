"""One query from its checked request to the last token of its answer (RAGCache §5.3, Algorithm 2;
RAGCache++ §3.6).

1. Embed the question; start the staged search; if the knowledge tree says the system prompt is
   not resident, have the controller warm it (shared work: recorded by the controller, not here)
   — with speculation on, only at a stage that could not speculate, since a speculation
   prefills the system prompt itself; with ``speculation="auto"`` only if its price pays.
2. A stage arrived: order its running top-k with the knowledge tree and build the prompt. If it
   differs from the live speculation's prompt, abort that one and, only if the prompt fits the
   model, its price pays (:mod:`~specrag.controller.speculation_policy`, with
   ``speculation="auto"``) and the prefill pool has room
   (:class:`~specrag.controller.gate.PrefillGate`), submit the new prompt speculatively. A later
   turn of a conversation continues its history instead, dropping the oldest turns that do not
   fit (:mod:`specrag.controller.conversation`).
3. The final result is known: order and build the final prompt. If the live speculation has
   exactly this prompt, adopt its stream; otherwise abort it and submit the final prompt through
   the gate.
4. Stream the answer; record the timeline and what the engine served from its prefix cache. A
   session's turn is recorded only now, once answered: a failed or abandoned turn changes nothing.
5. Abort all: whatever way the query ends, every engine request it still holds is aborted.

The answer is always generated from the final retrieval result: a speculation is adopted only when
its prompt is token-for-token the final prompt, and greedy decoding (the default) makes the text
identical.
A run owns its engine requests, so what is in flight is always what the live runs hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, replace

import numpy as np

from specrag.cache.hints import HintConfig, order_hint
from specrag.cache.layout import DocId, PromptLayout
from specrag.cache.ordering import PolicyName, get_policy
from specrag.cache.prefill_estimator import PrefillEstimator
from specrag.controller.config import ControllerConfig
from specrag.controller.conversation import TurnPrompt, TurnPrompts
from specrag.controller.flight import Flight, RetriedFlight
from specrag.controller.gate import PrefillGate, Slot
from specrag.controller.placement import Placed, Placement
from specrag.controller.query import AnswerDelta, AnswerDone, CheckedRequest, Source
from specrag.controller.replicas import Replica
from specrag.controller.sessions import SessionStore
from specrag.controller.speculation_policy import Price, SpeculationPolicy
from specrag.controller.timeline import Timeline
from specrag.controller.warmup import SystemPromptWarmer
from specrag.errors import EngineError, InvalidInputError, OverloadedError
from specrag.pipeline.engine import EngineOutput, check_prompt_fits, latest_cached_tokens, now
from specrag.pipeline.prompt import PromptBuilder
from specrag.retrieval.stage_stats import PlanKey, StageOutlook
from specrag.retrieval.vector_index import VectorIndex

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class QueryShared:
    """What the queries of one controller share; a run reads it and never changes it."""

    config: ControllerConfig
    placement: Placement
    index: VectorIndex
    builder: PromptBuilder
    prefill_estimator: PrefillEstimator
    gate: PrefillGate
    sessions: SessionStore
    warmer: SystemPromptWarmer
    hints: HintConfig
    turn_prompts: TurnPrompts
    speculation: SpeculationPolicy


class QueryRun:
    """One query: its checked request, its timeline and its engine requests; the steps are methods."""

    def __init__(self, shared: QueryShared, checked: CheckedRequest) -> None:
        self.checked = checked
        self.timeline = Timeline(arrival=now(), mode=checked.mode.name)
        self._shared = shared
        self._flights: list[Flight] = []
        self._speculation: Flight | None = None
        self._turn: TurnPrompt | None = None  # a later session turn's final prompt: what it kept
        self._plan: PlanKey | None = None  # what the index's stage figures for this search are under
        self._background: set[asyncio.Task[None]] = set()  # aborts of preempted speculations
        self.sources: tuple[Source, ...] = ()  # the final top-k, once known

    def request_ids(self) -> set[str]:
        """Engine requests this run has submitted and not yet aborted or seen end."""
        return {flight.request_id for flight in self._flights}

    async def events(self) -> AsyncGenerator[AnswerDelta | AnswerDone, None]:
        """Search, submit, then the answer's deltas and done; :meth:`abort_all` must follow."""
        answer = await self.retrieve()
        async for event in self.stream_answer(answer):
            yield event

    async def retrieve(self) -> Flight:
        """The staged search with speculation; returns the flight the answer comes from."""
        shared, checked, timeline = self._shared, self.checked, self.timeline
        if checked.planned is not None:  # a batch query: its batch searched and ordered it
            # No search ahead for a warm-up to hide behind: the final prompt is submitted at once.
            timeline.add(
                "planned", now(), position=checked.planned.position, documents=len(checked.planned.rows)
            )
            return await self.final_known(list(checked.planned.rows))
        loop = asyncio.get_running_loop()
        timeline.embed_start = now()
        vector = await loop.run_in_executor(None, shared.index.embed_query, checked.request.question)
        timeline.search_start = now()
        config = shared.config
        plan = shared.index.stage_plan(config.num_stages if checked.speculate else 1, config.stage_schedule)
        self._plan = shared.index.plan_key(checked.k, plan.num_stages, plan.schedule)
        if plan.num_stages == 1:
            self._warm_up(0)
        final_rows: list[int] = []
        search = shared.index.search_staged(
            vector,
            checked.k,
            num_stages=plan.num_stages,
            schedule=plan.schedule,
            query_text=checked.request.question,  # the lexical channel of a hybrid index
        )
        async with contextlib.aclosing(search) as staged:
            async for stage in staged:
                rows = self._rows(stage.ids)
                timeline.add("stage", now(), stage=stage.stage, done=stage.done, documents=len(rows))
                if stage.done:
                    final_rows = rows
                    break
                await self.stage_arrived(rows, stage.stage)
        timeline.search_end = now()
        return await self.final_known(final_rows)

    async def stage_arrived(self, rows: list[int], stage: int) -> None:
        """Speculate on a stage's running top-k if it changed and the prefill pool has room.

        A running top-k may make a longer prompt than the final one: if it does not fit the
        model, it is not speculated on, and the query goes on (only the final prompt must fit).
        """
        if not self.checked.speculate:
            return
        placed = self._prompt(rows, final=False)
        speculation = self._speculation
        if speculation is not None and speculation.layout.token_ids == placed.layout.token_ids:
            return
        if speculation is not None:
            await self._drop(speculation)
        tokens = len(placed.layout.token_ids)
        timeline = self.timeline
        if tokens + self.checked.sampling.max_tokens > placed.replica.engine.max_model_len:
            timeline.add("spec_skip", now(), stage=stage, reason="too_long", prompt_tokens=tokens)
            self._warm_up(stage)
            return
        price = self._price(placed, stage)
        if price is not None and not price.pays:
            timeline.speculations_priced_out += 1
            timeline.add("spec_skip", now(), stage=stage, reason="price", **price.detail())
            self._warm_up(stage)
            return
        slot = self._shared.gate.try_speculate(
            compute_tokens=tokens - placed.predicted_cached,
            engine_waiting=placed.replica.engine.load().engine_waiting,
            preempt=self._preempted,
        )
        if slot is None:
            timeline.add("spec_skip", now(), stage=stage, reason="no_room")
            self._warm_up(stage)
        else:
            self._speculation = self._launch(
                placed, slot, speculative=True, predicted=placed.predicted_cached
            )
            timeline.speculations += 1
            timeline.add(
                "spec_submit",
                self._speculation.submitted_at,
                stage=stage,
                request_id=self._speculation.request_id,
                replica=placed.replica.name,
                **(price.detail() if price is not None else {}),
            )

    async def final_known(self, rows: list[int]) -> Flight:
        """Adopt the speculation if its prompt is the final one; otherwise submit the final prompt."""
        shared, timeline = self._shared, self.timeline
        passages = [shared.builder.store.passage(row) for row in rows]
        timeline.documents = [passage.id for passage in passages]
        self.sources = tuple(Source(passage.id, passage.title) for passage in passages)
        placed = self._prompt(rows, final=True)
        layout, predicted = placed.layout, placed.predicted_cached
        if self._turn is not None and self._turn.dropped:
            dropped = self._turn.dropped
            timeline.dropped_turns = len(dropped)
            timeline.add(
                "history_dropped",
                now(),
                turns=[turn.number for turn in dropped],
                tokens=sum(len(turn.tokens) for turn in dropped),
            )
        speculation = self._speculation
        if speculation is not None and speculation.layout.token_ids == layout.token_ids:
            timeline.adopted = True
            speculation.adopt()
            timeline.add("adopt", now(), request_id=speculation.request_id, replica=speculation.replica.name)
            return speculation
        if speculation is not None:
            await self._drop(speculation)
        check_prompt_fits(len(layout.token_ids), self.checked.sampling, placed.replica.engine.max_model_len)
        gate = shared.gate
        if gate.waiting >= shared.config.max_queue:
            # Bounded queueing: past the limit a caller is told to come back instead of waiting
            # behind an unbounded line (the service answers 429 with Retry-After).
            raise OverloadedError(
                f"{gate.waiting} requests already wait for the engine (limit {shared.config.max_queue})",
                retry_after_s=max(1.0, gate.waiting / gate.max_prefill_bs * 0.5),
            )
        queued_at = now()
        if gate.pool >= gate.max_prefill_bs or gate.waiting:
            timeline.add("queued", queued_at, pool=gate.pool, waiting=gate.waiting)
        # A session's order is its history's, a batch query's its plan's.
        reorderable = self.checked.mode.ordering and self._turn is None and self.checked.planned is None
        slot = await gate.admit(predicted, len(layout.token_ids) - predicted, rows if reorderable else ())
        timeline.queued_s = now() - queued_at
        if not placed.replica.available:  # excluded while the request waited for its slot
            placed = self._prompt(rows, final=True)
        if slot.ordering is not None and slot.ordering.doc_ids != placed.layout.document_ids():
            placed = self._reordered(placed, rows, slot.ordering.doc_ids)
            timeline.add("reordered", now(), documents=len(rows))
        # The cache may have changed while the request waited for its slot: predict again.
        final = self._launch(placed, slot, speculative=False, predicted=self._predicted(placed))
        self._note_route(placed)
        timeline.add("final_submit", final.submitted_at, request_id=final.request_id)
        return final

    async def stream_answer(self, flight: Flight) -> AsyncIterator[AnswerDelta | AnswerDone]:
        """The answer's deltas, then :class:`AnswerDone`; a session learns the turn at the end (the
        tree learned the prompt at its first token, see :meth:`_prefilled`)."""
        shared, timeline, session = self._shared, self.timeline, self.checked.session
        timeline.answer_submit = flight.submitted_at
        timeline.predicted_cached_tokens = flight.predicted_cached_tokens
        timeline.predicted_beside_prefill = flight.others_prefilling
        timeline.prompt_tokens = len(flight.layout.token_ids)
        texts: list[str] = []
        tokens: list[int] = []
        finish_reason: str | None = None
        async for output in self._outputs_with_retry(flight):
            if timeline.first_token is None:
                # When the caller can see it: an adopted speculation may have produced its first
                # token before the search ended, but it is only known right once the search has.
                timeline.first_token = now()
                timeline.answer_scheduled = flight.scheduled_at
                timeline.add("first_token", timeline.first_token, cached_tokens=output.cached_tokens)
            # An OpenAI server reports the count only with its last output: keep the latest (of the
            # answer's prompt: a migration's prompt is longer).
            if not timeline.migrations:
                timeline.cached_prompt_tokens = (
                    latest_cached_tokens(output, timeline.cached_prompt_tokens) or 0
                )
            if output.document_kv_tokens is not None:
                timeline.document_kv_tokens = output.document_kv_tokens
            texts.append(output.text)
            tokens.extend(output.token_ids)
            finish_reason = output.finish_reason or finish_reason
            if output.text or output.token_ids:
                yield AnswerDelta(output.text, output.token_ids)
        timeline.done = now()
        timeline.add("done", timeline.done)
        if logger.isEnabledFor(logging.DEBUG):  # `serve -v`: one line per answered query
            summary = {k: v for k, v in timeline.to_dict().items() if k not in ("events", "documents")}
            logger.debug("query answered (%s): %s", finish_reason, summary)
        if session is not None and finish_reason != "abort":  # the only place a session changes
            kept = self._turn.kept if self._turn is not None else ()
            shared.sessions.record_turn(session, kept, flight.layout, tokens)
        yield AnswerDone("".join(texts), finish_reason, timeline, flight.layout, self.sources)

    async def abort_all(self) -> None:
        """Abort every engine request the run still holds (idempotent).

        One failed abort must not leave the others running: each is tried, and the first
        failure is raised once all were.
        """
        failures: list[Exception] = []
        for flight in list(self._flights):
            try:
                await flight.abort()
            except Exception as error:
                failures.append(error)
            finally:
                self._forget(flight)
        self._speculation = None
        if failures:
            raise EngineError(
                f"{len(failures)} of the query's engine requests could not be aborted: {failures[0]}"
            ) from failures[0]

    # ------------------------------------------------------------------ helpers

    def _warm_up(self, stage: int) -> None:
        """Prefill the system prompt where it is cold, if this query's mode warms up (and, with
        ``speculation="auto"``, if its price pays with the search left after ``stage``).

        A speculation prefills the system prompt with its documents, so with speculation on this
        runs only at a stage that could not speculate: a warm-up started beside the search would
        hold the prefill slot the first stage's speculation needs (after a cache reset it kept
        every stage of the query's search from speculating).
        """
        shared, timeline = self._shared, self.timeline
        if not self.checked.mode.warmup or not shared.warmer.needed():
            return
        detail: dict[str, float | int] = {}
        if shared.speculation.priced:
            system_tokens = len(shared.builder.system_layout_tokens())
            price = shared.speculation.warmup(
                self._outlook(stage), system_tokens, self._waiting(shared.placement.replicas)
            )
            detail = price.detail()
            if not price.pays:
                timeline.warmups_priced_out += 1
                timeline.add("warmup_skip", now(), stage=stage, **detail)
                return
        if shared.warmer.start_if_cold():
            timeline.add("warmup_start", now(), stage=stage, **detail)
            timeline.warmed = True

    def _price(self, placed: Placed, stage: int) -> Price | None:
        """What speculating on this stage's prompt is expected to gain and cost (None: not priced)."""
        policy = self._shared.speculation
        if not policy.priced:
            return None
        cached = placed.predicted_cached
        computed = len(placed.layout.token_ids) - cached
        ordered = self.checked.mode.ordering  # the tree orders the documents: any order of them will do
        return policy.speculation(
            self._outlook(stage), ordered, cached, computed, self._waiting((placed.replica,))
        )

    def _outlook(self, stage: int) -> StageOutlook:
        """The index's figures for this search after ``stage`` (0: its start)."""
        assert self._plan is not None and self.timeline.search_start is not None
        elapsed = now() - self.timeline.search_start
        return self._shared.index.stage_stats.outlook(self._plan, stage, elapsed)

    def _waiting(self, replicas: Sequence[Replica]) -> int:
        """Requests that wait for these engines now: the engines' own backlog, our requests before
        their first token and final requests queued at the gate."""
        loads = [replica.engine.load() for replica in replicas]
        return sum(load.engine_waiting + load.prefilling for load in loads) + self._shared.gate.waiting

    def _rows(self, ids: np.ndarray) -> list[int]:
        """Corpus rows of a stage's ids in rank order; padding and repeats (synthetic rows) dropped."""
        return list(self._shared.index.ranked_rows(ids))

    def _prompt(self, rows: list[int], final: bool) -> Placed:
        """The prompt for these documents, where it goes and that replica's estimate of its cached tokens.

        Its cost is the controller's own overhead per stage, so it is timed into the timeline.
        """
        started = now()
        try:
            return self._ordered_prompt(rows, final)
        finally:
            self.timeline.controller_s += now() - started

    def _ordered_prompt(self, rows: list[int], final: bool) -> Placed:
        shared, checked = self._shared, self.checked
        session, question = checked.session, checked.question_token_ids
        # The final prompt prefers the speculation's replica on a tie, so adoption stays possible.
        prefer = self._speculation.replica if self._speculation is not None else None
        if session is not None and session.turns:
            budget = shared.placement.replicas[0].engine.max_model_len - checked.sampling.max_tokens
            turn = shared.turn_prompts.build(session, rows, question, budget)
            if final:
                self._turn = turn
            placed = shared.placement.place_prompt(turn.layout, prefer=prefer)
            # A session's prompt continues its history, which the engine still holds (the tree does
            # not follow sessions): that is the prediction.
            session_cached = turn.predicted_cached_tokens(session, placed.replica.engine.block_size)
            return replace(placed, predicted_cached=session_cached)
        planned = checked.planned  # a batch plan's order is kept as it is
        policy = get_policy(
            shared.config.ordering_policy if checked.mode.ordering and not planned else PolicyName.RETRIEVAL
        )
        return shared.placement.place_documents(
            policy, planned.order if planned else rows, lambda order: self._layout(rows, order), prefer=prefer
        )

    def _layout(self, rows: list[int], order: Sequence[DocId]) -> PromptLayout:
        """The prompt with the documents in ``order``; with ordering on, a hint gives ``rows``' rank."""
        ordered = [int(doc_id) for doc_id in order]
        hint = order_hint(rows, ordered, self._shared.hints) if self.checked.mode.ordering else None
        return self._shared.builder.build_with_question_tokens(ordered, self.checked.question_token_ids, hint)

    def _reordered(self, placed: Placed, rows: list[int], order: Sequence[DocId]) -> Placed:
        """The final prompt in the document order window admission chose when it admitted it."""
        predicted = placed.replica.tree.cached_prefix(order).tokens
        return replace(placed, layout=self._layout(rows, order), predicted_cached=predicted)

    def _predicted(self, placed: Placed) -> int:
        """The replica's estimate of the engine's hit for this prompt now (a session's is its history)."""
        if self.checked.session is not None:
            return placed.predicted_cached
        return placed.replica.tree.cached_prefix(placed.layout.document_ids()).tokens

    def _launch(
        self, placed: Placed, slot: Slot, speculative: bool, predicted: int, sent: tuple[int, ...] = ()
    ) -> Flight:
        sampling = self.checked.sampling
        if self.checked.document_kv:
            sampling = replace(sampling, document_kv=placed.layout.stored_spans())
        try:
            check_prompt_fits(len(placed.layout.token_ids), sampling, placed.replica.engine.max_model_len)
        except InvalidInputError:
            slot.release()  # the slot was taken for a request that will never exist
            raise
        flight = Flight(placed, sampling, slot, speculative, sent)
        flight.predicted_cached_tokens = predicted
        # A session's prompts are the session's, not the tree's; a migration's ends in an answer.
        if self.checked.session is None and not sent:
            placed.replica.tree.record_pending(placed.layout)
            flight.on_prefilled = self._prefilled
        self._flights.append(flight)
        return flight

    def _prefilled(self, flight: Flight) -> None:
        """A prompt of ours reached its first token: its replica's tree learns it was served and
        that its blocks are cached (an aborted speculation's too: its prefill is done)."""
        tree = flight.replica.tree
        tree.record_served(flight.layout, flight.cached_tokens)
        tree.record_prefilled(flight.layout)

    def _note_route(self, placed: Placed) -> None:
        """The timeline (and so /metrics) says where the answer's prompt went, and why."""
        self.timeline.add(
            "route",
            now(),
            replica=placed.replica.name,
            reason=placed.reason,
            estimate_ms=round(placed.estimate_s * 1000, 3),
            predicted_cached_tokens=placed.predicted_cached,
        )

    def _measure_prefill(self, flight: Flight) -> None:
        """An answer ended: its prefill time refits the engine's profile, which the tree then costs with."""
        sample = flight.prefill_sample()
        if sample is None:
            return
        profile = self._shared.prefill_estimator.record(*sample)
        if profile is not None:  # every replica runs the same model on the same kind of engine
            for replica in self._shared.placement.replicas:
                replica.tree.use_profile(profile)

    def _forget(self, flight: Flight) -> None:
        """Drop an aborted flight from the run (the controller's close may have done it already)."""
        if flight in self._flights:
            self._flights.remove(flight)

    async def _drop(self, flight: Flight, reason: str = "stale") -> None:
        """Abort a speculation (its top-k went stale, or a final request preempted it) and count
        the prefill it may have spent."""
        if self._speculation is flight:
            self._speculation = None
        await flight.abort()
        self._forget(flight)
        timeline = self.timeline
        timeline.aborted_speculations += 1
        timeline.wasted_spec_prefill_tokens += len(flight.layout.token_ids) - (flight.cached_tokens or 0)
        timeline.add("spec_abort", now(), request_id=flight.request_id, reason=reason)

    def _preempted(self) -> None:
        """Another query's final request took the live speculation's slot: abort it in the
        background (the gate calls this synchronously; the abort awaits the engine).

        Only the live speculation's slot can be preempted: a dropped one is being given back, an
        adopted one is final work (:meth:`Slot.adopt`).
        """
        flight = self._speculation
        if flight is None:
            return  # dropped meanwhile: its slot is on its way back anyway
        self._speculation = None
        self.timeline.preempted_speculations += 1
        name = f"preempt-{flight.request_id}"
        task = asyncio.create_task(self._drop(flight, reason="preempted"), name=name)
        self._background.add(task)
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Task[None]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.warning("aborting a preempted speculation failed: %s", task.exception())

    async def _outputs_with_retry(self, flight: Flight) -> AsyncIterator[EngineOutput]:
        """The answer's outputs, resubmitted elsewhere on a failure before the first token
        (:class:`~specrag.controller.flight.RetriedFlight`); the answering request's prefill
        refits the profile."""
        shared = self._shared
        answer = RetriedFlight(flight, shared.placement, shared.config.first_token_timeout_s, self._resubmit)
        async for output in answer.outputs():
            yield output
        self._measure_prefill(answer.flight)

    async def _resubmit(
        self, placed: Placed, failed: Flight, error: EngineError, sent: tuple[int, ...]
    ) -> Flight:
        """The answer's prompt again, as placed after ``failed`` failed, through the prefill gate;
        after the first token, with the tokens already ``sent`` (a migration)."""
        timeline = self.timeline
        if sent:
            timeline.migrations += 1
            timeline.add(
                "migrate",
                now(),
                reason=str(error),
                replica=failed.replica.name,
                to=placed.replica.name,
                tokens_sent=len(sent),
            )
        else:
            timeline.add("retry", now(), reason=str(error), replica=failed.replica.name)
        slot = await self._shared.gate.admit(placed.predicted_cached, len(placed.layout.token_ids))
        flight = self._launch(placed, slot, speculative=False, predicted=self._predicted(placed), sent=sent)
        self._note_route(placed)
        if not sent:  # a migration's prompt is not the answer's: its figures stay the first request's
            timeline.answer_submit = flight.submitted_at
        return flight
