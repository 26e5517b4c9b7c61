"""One query from its checked request to the last token of its answer (RAGCache §5.3, Algorithm 2;
RAGCache++ §3.6).

1. Embed the question (a follow-up's joined with the questions before it,
   :mod:`specrag.retrieval.conversational`); start the staged search (in one stage when, priced
   with a typical prompt, no stage is expected to launch a speculation); if the knowledge tree says
   the system prompt is not resident, have the controller warm it (shared work: recorded by the
   controller, not here)
   — with speculation on, only at a stage that could not speculate, since a speculation
   prefills the system prompt itself; with ``speculation="auto"`` only if its price pays.
2. A stage arrived: order its running top-k with the knowledge tree and build the prompt. If it
   differs from the live speculation's prompt, abort that one and, only if the prompt fits the
   model, its price pays and the prefill pool has room, submit the new prompt speculatively
   (:mod:`specrag.controller.speculation_steps`). A later turn of a conversation continues its
   history instead, dropping the oldest turns that do not fit (:mod:`specrag.controller.conversation`).
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

import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import asdict, replace

import numpy as np

from specrag.cache.hints import order_hint
from specrag.cache.layout import DocId, PromptLayout
from specrag.cache.ordering import PolicyName, get_policy
from specrag.controller.conversation import TurnPrompt
from specrag.controller.fitting import check_final_prompt_fits
from specrag.controller.flight import Flight, RetriedFlight
from specrag.controller.gate import Slot
from specrag.controller.placement import Placed, PlacementMemo
from specrag.controller.query import AnswerDelta, AnswerDone, CheckedRequest, Source
from specrag.controller.query_shared import QueryShared
from specrag.controller.speculation_steps import SpeculationSteps
from specrag.controller.tiers import document_kv_sampling, fresh_last
from specrag.controller.timeline import Timeline
from specrag.errors import EngineError, OverloadedError
from specrag.pipeline.engines.protocol import EngineOutput, latest_cached_tokens, now
from specrag.retrieval.backends.shards.merge import ShardAnswers
from specrag.retrieval.conversational import conversation_query_on_loop
from specrag.retrieval.vector_index import StagedSearch

__all__ = ["QueryRun"]

logger = logging.getLogger(__name__)


class QueryRun:
    """One query: its checked request, its timeline and its engine requests. The search, the final
    prompt and the answer are its methods; the speculation during the search is its
    :class:`~specrag.controller.speculation_steps.SpeculationSteps`, which places and launches
    through this run (:meth:`place`, :meth:`launch`), so every engine request is the run's."""

    def __init__(self, shared: QueryShared, checked: CheckedRequest) -> None:
        self.checked = checked
        self.timeline = Timeline(arrival=now(), mode=checked.mode.name)
        self._shared = shared
        self._flights: list[Flight] = []
        self._turn: TurnPrompt | None = None  # a later session turn's final prompt: what it kept
        self._speculating = SpeculationSteps(shared, checked, self.timeline, self)
        self._answer: RetriedFlight | None = None  # the answer's stream, once it is read
        self.sources: tuple[Source, ...] = ()  # the final top-k, once known
        self._placements = PlacementMemo()  # orders and prompts from one stage to the next

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
            self._note_shards(checked.planned.shards)
            return await self.final_known(list(checked.planned.rows))
        timeline.embed_start = now()
        request = checked.request
        # A follow-up is searched with the questions before it, its session's or its chat's.
        previous = checked.session.questions if checked.session is not None else request.previous_questions
        query = await conversation_query_on_loop(shared.index, request.question, previous)
        if query.joined:
            timeline.add("conversation", now(), questions=query.joined)
        timeline.search_start = now()
        config = shared.config
        answers = ShardAnswers() if request.allow_partial else None

        def search_in(stages: int | None) -> StagedSearch:
            # The query's text feeds the lexical channel of a hybrid index.
            plan = shared.index.stage_plan(stages, config.stage_schedule)
            return shared.index.search_staged(
                query.vector, checked.k, plan, query_text=query.text, shard_answers=answers
            )

        search = search_in(config.num_stages if checked.speculation.speculates else 1)
        if search.num_stages > 1 and not self._speculating.stages_pay(search):
            search = search_in(1)
        self._speculating.search = search
        if search.num_stages == 1:
            self._speculating.warm_up(0)
        final_rows: list[int] = []
        async with contextlib.aclosing(search) as staged:
            async for stage in staged:
                rows = self._rows(stage.ids)
                timeline.add("stage", now(), stage=stage.stage, done=stage.done, documents=len(rows))
                if stage.done:
                    final_rows = rows
                    break
                await self._speculating.stage_arrived(rows, stage.stage)
        timeline.search_end = now()
        self._note_shards(answers)
        return await self.final_known(final_rows)

    def _note_shards(self, answers: ShardAnswers | None) -> None:
        """Name in the timeline the shards that answered a search that accepted a partial top-k."""
        if answers is not None and answers.answered:  # a sharded index's search
            self.timeline.add("shards", now(), answered=answers.answered, missing=answers.missing)

    async def final_known(self, rows: list[int]) -> Flight:
        """Adopt the speculation if its prompt is the final one; otherwise submit the final prompt."""
        shared, timeline = self._shared, self.timeline
        passages = [shared.builder.store.passage(row) for row in rows]
        timeline.documents = [passage.id for passage in passages]
        self.sources = tuple(Source(passage.id, passage.title) for passage in passages)
        placed = self.place(rows, final=True)
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
        speculation = self._speculating.live
        if speculation is not None and speculation.layout.token_ids == layout.token_ids:
            timeline.adopted = True
            speculation.adopt()
            timeline.add("adopt", now(), request_id=speculation.request_id, replica=speculation.replica.name)
            return speculation
        if speculation is not None:
            await self._speculating.drop(speculation)
        check_final_prompt_fits(
            len(layout.token_ids),
            len(rows),
            lambda count: len(self._ordered_prompt(rows[:count], final=False).layout.token_ids),
            self.checked.sampling,
            placed.replica.engine.max_model_len,
        )
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
        try:
            placed = self._placed_after_wait(placed, rows, slot)
        except BaseException:
            # No request holds the slot yet (e.g. the only engine is being replaced: no replica to
            # place on): kept, it would shut the prefill pool for good.
            slot.release()
            raise
        # The cache may have changed while the request waited for its slot: predict again.
        final = self.launch(placed, slot, speculative=False, predicted=self._predicted(placed))
        self._note_route(placed)
        timeline.add("final_submit", final.submitted_at, request_id=final.request_id)
        return final

    def _placed_after_wait(self, placed: Placed, rows: list[int], slot: Slot) -> Placed:
        """The final prompt placed again if its replica left while it waited for ``slot``, and in
        the document order the slot carries (the window order's)."""
        if not placed.replica.available:  # excluded (or its engine replaced) while it waited
            placed = self.place(rows, final=True)
        if slot.ordering is not None and slot.ordering.doc_ids != placed.layout.document_ids():
            placed = self._reordered(placed, rows, slot.ordering.doc_ids)
            self.timeline.add("reordered", now(), documents=len(rows))
        return placed

    async def stream_answer(self, flight: Flight) -> AsyncIterator[AnswerDelta | AnswerDone]:
        """The answer's deltas, then :class:`AnswerDone`; a session learns the turn at the end (the
        tree learned the prompt at its first token, see :meth:`_prefilled`)."""
        shared, timeline, session = self._shared, self.timeline, self.checked.session
        timeline.answer_submit = flight.submitted_at
        timeline.answer_beside = asdict(flight.load_at_submit)
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
                answering = self._answering(flight)
                timeline.answer_queued = answering.queued_at
                timeline.answer_scheduled = answering.scheduled_at
                timeline.answer_engine_first_token = answering.engine_first_token_at
                timeline.answer_received = answering.first_token_at
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
            shared.sessions.record_turn(session, kept, flight.layout, tokens, self.checked.request.question)
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
                self.forget(flight)
        self._speculating.live = None
        if failures:
            raise EngineError(
                f"{len(failures)} of the query's engine requests could not be aborted: {failures[0]}"
            ) from failures[0]

    # ------------------------------------------------------------------ helpers

    def _rows(self, ids: np.ndarray) -> list[int]:
        """Corpus rows of a stage's ids in rank order; padding and repeats (synthetic rows) dropped."""
        return list(self._shared.index.ranked_rows(ids))

    def place(self, rows: list[int], final: bool) -> Placed:
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
        prefer = self._speculating.live.replica if self._speculating.live is not None else None
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
            policy,
            planned.order if planned else rows,
            lambda order: self._layout(rows, order),
            prefer=prefer,
            memo=self._placements,
        )

    def _layout(self, rows: list[int], order: Sequence[DocId]) -> PromptLayout:
        """The prompt with the documents in ``order``; with ordering on, a hint gives ``rows``' rank."""
        ordered = fresh_last([int(doc_id) for doc_id in order], rows, self.checked.document_kv_fresh)
        hint = order_hint(rows, ordered, self._shared.hints) if self.checked.mode.ordering else None
        return self._shared.builder.build_with_question_tokens(ordered, self.checked.question_token_ids, hint)

    def _reordered(self, placed: Placed, rows: list[int], order: Sequence[DocId]) -> Placed:
        """The final prompt in the document order the window order chose when the gate let it in."""
        layout = self._layout(rows, order)
        return replace(placed, layout=layout, predicted_cached=placed.replica.tree.prompt_hit(layout))

    def _predicted(self, placed: Placed) -> int:
        """The replica's estimate of the engine's hit for this prompt now (a session's is its history)."""
        if self.checked.session is not None:
            return placed.predicted_cached
        return placed.replica.tree.prompt_hit(placed.layout)

    def launch(
        self, placed: Placed, slot: Slot, speculative: bool, predicted: int, sent: tuple[int, ...] = ()
    ) -> Flight:
        """Submit ``placed`` on ``slot`` as an engine request this run owns until it ends or is
        aborted; after a first token elsewhere, with the tokens already ``sent`` (a migration)."""
        sampling = self.checked.sampling
        if self.checked.document_kv:
            sampling = document_kv_sampling(
                sampling,
                placed.layout,
                self.checked.document_kv_fresh,
                after_system=self.checked.document_kv_after_system,
            )
        # Its length was checked before (the final prompt in final_known, a speculation by
        # SpeculationSteps); a resubmission elsewhere is checked by that engine's own contract.
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
        that its blocks are cached (an aborted speculation's too: its prefill is done); a document-KV
        prompt's blocks are salted, another cache than the tree's."""
        tree = flight.replica.tree
        tree.record_served(flight.layout, flight.cached_tokens)
        tree.record_prefilled(flight.layout, salted=flight.sampling.cache_salt is not None)

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

    def forget(self, flight: Flight) -> None:
        """Drop an aborted flight from the run (the controller's close may have done it already)."""
        if flight in self._flights:
            self._flights.remove(flight)

    def _answering(self, flight: Flight) -> Flight:
        """The request the answer's outputs come from now: ``flight``, or its retry."""
        return self._answer.flight if self._answer is not None else flight

    async def _outputs_with_retry(self, flight: Flight) -> AsyncIterator[EngineOutput]:
        """The answer's outputs, resubmitted elsewhere on a failure before the first token
        (:class:`~specrag.controller.flight.RetriedFlight`); the answering request's prefill
        refits the profile."""
        shared = self._shared
        config = shared.config
        answer = RetriedFlight(
            flight,
            shared.placement,
            config.first_token_timeout_s,
            self._resubmit,
            inter_token_timeout_s=config.inter_token_timeout_s,
        )
        self._answer = answer
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
        flight = self.launch(placed, slot, speculative=False, predicted=self._predicted(placed), sent=sent)
        self._note_route(placed)
        if not sent:  # a migration's prompt is not the answer's: its figures stay the first request's
            timeline.answer_submit = flight.submitted_at
            timeline.answer_beside = asdict(flight.load_at_submit)
        return flight
