"""The speculation steps of one query (RAGCache §5.3, Algorithm 2): what its run does while the
search is still going.

At each stage whose running top-k changed, the live speculation (if any) is aborted and, only if
the new prompt fits the model, its price pays now rather than at a later stage
(:mod:`~specrag.controller.speculation_policy`, with ``speculation="auto"``) and the prefill pool
has room (:class:`~specrag.controller.gate.PrefillGate`), the new prompt is submitted
speculatively. At a stage that could not speculate the system prompt is warmed where it is cold (a
speculation prefills it itself). Apart from
:mod:`specrag.controller.run` so that the run reads as the query's path (search, final prompt,
answer) while the speculation's bookkeeping (the live flight, its price, its aborts, a preemption
by another query) stays here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Protocol

from specrag.controller.flight import Flight
from specrag.controller.gate import Slot
from specrag.controller.placement import Placed
from specrag.controller.query import CheckedRequest
from specrag.controller.query_shared import QueryShared
from specrag.controller.replicas import Replica
from specrag.controller.speculation_policy import Price
from specrag.controller.timeline import Timeline
from specrag.pipeline.engines.base import prompt_fits
from specrag.pipeline.engines.protocol import now
from specrag.retrieval.search.stage_stats import StageOutlook
from specrag.retrieval.vector_index import StagedSearch

__all__ = ["RunHooks", "SpeculationSteps"]

logger = logging.getLogger(__name__)


class RunHooks(Protocol):
    """What the speculation steps ask of their query's run: a prompt for a stage's documents,
    an engine request launched and owned by the run, and a flight forgotten once aborted."""

    def place(self, rows: list[int], final: bool) -> Placed: ...

    def launch(self, placed: Placed, slot: Slot, speculative: bool, predicted: int) -> Flight: ...

    def forget(self, flight: Flight) -> None: ...


class SpeculationSteps:
    """One query's speculation: the live speculative flight, the stages' prices, the warm-up."""

    def __init__(
        self, shared: QueryShared, checked: CheckedRequest, timeline: Timeline, run: RunHooks
    ) -> None:
        self._shared = shared
        self._checked = checked
        self._timeline = timeline
        self._run = run
        self.live: Flight | None = None  # the speculation in flight (adopted: the answer's flight)
        self.search: StagedSearch | None = None  # the query's staged search, whose outlook prices
        self._background: set[asyncio.Task[None]] = set()  # aborts of preempted speculations

    def stages_pay(self, search: StagedSearch) -> bool:
        """Whether the query's search, about to start, should run its stages: not when its price
        says no stage is expected to launch a speculation
        (:meth:`~specrag.controller.speculation_policy.SpeculationPolicy.unstaged`), since every
        stage's top-k is then ordered and built into a prompt for nothing. The decision and its
        best stage's figures go in the timeline (``unstaged``)."""
        self.search = search
        replicas = self._shared.placement.replicas
        waiting = min(self._waiting((replica,)) for replica in replicas)
        price = self._checked.speculation.unstaged(self._outlook(0), self._checked.mode.ordering, waiting)
        if price is None:
            return True
        self._timeline.add("unstaged", now(), **price.detail())
        return False

    async def stage_arrived(self, rows: list[int], stage: int) -> None:
        """Speculate on a stage's running top-k if it changed and the prefill pool has room.

        A running top-k may make a longer prompt than the final one: if it does not fit the
        model, it is not speculated on, and the query goes on (only the final prompt must fit).
        """
        if not self._checked.speculation.speculates:
            return
        placed = self._run.place(rows, final=False)
        speculation = self.live
        if speculation is not None and speculation.layout.token_ids == placed.layout.token_ids:
            return
        if speculation is not None:
            await self.drop(speculation)
        tokens = len(placed.layout.token_ids)
        timeline = self._timeline
        if not prompt_fits(tokens, self._checked.sampling, placed.replica.engine.max_model_len):
            timeline.add("spec_skip", now(), stage=stage, reason="too_long", prompt_tokens=tokens)
            self.warm_up(stage)
            return
        price = self._price(placed, stage)
        if price is not None and not price.pays:
            timeline.speculations_priced_out += 1
            reason = "later_stage" if price.deferred else "price"
            timeline.add("spec_skip", now(), stage=stage, reason=reason, **price.detail())
            if not price.deferred:  # the later stage's speculation prefills the system prompt itself
                self.warm_up(stage)
            return
        slot = self._shared.gate.try_speculate(
            compute_tokens=tokens - placed.predicted_cached,
            engine_waiting=placed.replica.engine.load().engine_waiting,
            preempt=self._preempted,
        )
        if slot is None:
            timeline.add("spec_skip", now(), stage=stage, reason="no_room")
            self.warm_up(stage)
        else:
            self.live = self._run.launch(placed, slot, speculative=True, predicted=placed.predicted_cached)
            timeline.speculations += 1
            timeline.add(
                "spec_submit",
                self.live.submitted_at,
                stage=stage,
                request_id=self.live.request_id,
                replica=placed.replica.name,
                **(price.detail() if price is not None else {}),
            )

    def warm_up(self, stage: int) -> None:
        """Prefill the system prompt where it is cold, if this query's mode warms up (and, with
        ``speculation="auto"``, if its price pays with the search left after ``stage``).

        A speculation prefills the system prompt with its documents, so with speculation on this
        runs only at a stage that could not speculate, and not at one that waits for a later
        stage's: a warm-up started beside the search would hold the prefill slot that stage's
        speculation needs (after a cache reset it kept every stage of the query's search from
        speculating).
        """
        shared, timeline = self._shared, self._timeline
        if not self._checked.mode.warmup or not shared.warmer.needed():
            return
        detail: dict[str, float | int] = {}
        system_tokens = len(shared.builder.system_layout_tokens())
        price = self._checked.speculation.warmup(
            self._outlook(stage), system_tokens, self._waiting(shared.placement.replicas)
        )
        if price is not None:
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
        cached = placed.predicted_cached
        computed = len(placed.layout.token_ids) - cached
        ordered = self._checked.mode.ordering  # the tree orders the documents: any order of them will do
        return self._checked.speculation.speculation(
            self._outlook(stage), ordered, cached, computed, self._waiting((placed.replica,))
        )

    def _outlook(self, stage: int) -> StageOutlook:
        """The index's figures for this search after ``stage`` (0: its start)."""
        assert self.search is not None and self._timeline.search_start is not None
        return self.search.outlook(stage, now() - self._timeline.search_start)

    def _waiting(self, replicas: Sequence[Replica]) -> int:
        """Requests that wait for these engines now: the engines' own backlog, our requests before
        their first token and final requests queued at the gate."""
        loads = [replica.engine.load() for replica in replicas]
        return sum(load.engine_waiting + load.prefilling for load in loads) + self._shared.gate.waiting

    async def drop(self, flight: Flight, reason: str = "stale") -> None:
        """Abort a speculation (its top-k went stale, or a final request preempted it) and count
        the prefill it may have spent."""
        if self.live is flight:
            self.live = None
        await flight.abort()
        self._run.forget(flight)
        timeline = self._timeline
        timeline.aborted_speculations += 1
        timeline.wasted_spec_prefill_tokens += len(flight.layout.token_ids) - (flight.cached_tokens or 0)
        timeline.add("spec_abort", now(), request_id=flight.request_id, reason=reason)

    def _preempted(self) -> None:
        """Another query's final request took the live speculation's slot: abort it in the
        background (the gate calls this synchronously; the abort awaits the engine).

        Only the live speculation's slot can be preempted: a dropped one is being given back, an
        adopted one is final work (:meth:`Slot.adopt`).
        """
        flight = self.live
        if flight is None:
            return  # dropped meanwhile: its slot is on its way back anyway
        self.live = None
        self._timeline.preempted_speculations += 1
        name = f"preempt-{flight.request_id}"
        task = asyncio.create_task(self.drop(flight, reason="preempted"), name=name)
        self._background.add(task)
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Task[None]) -> None:
        self._background.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.warning("aborting a preempted speculation failed: %s", task.exception())
