"""What happened to one query, and when: the record every latency figure is computed from.

Times are ``time.perf_counter()`` seconds; the exported form gives milliseconds relative to the
query's arrival so a timeline can be plotted or compared across processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class TimelineEvent:
    """One step: ``kind`` is stage, warmup_start, warmup_skip (priced out), spec_submit,
    spec_abort, spec_skip (``reason``: ``too_long``, a running top-k's prompt too long for the
    model; ``price``, its expected gain not above its expected cost; ``no_room``, the prefill
    gate refused), history_dropped (a conversation's oldest turns left the context), adopt,
    queued, final_submit, retry, first_token or done. A priced decision (spec_submit, spec_skip
    for its price, warmup_start, warmup_skip) carries the price's figures
    (:meth:`~specrag.controller.speculation_policy.Price.detail`).

    A warm-up the query triggered is shared work that may outlive it: the query notes only its
    start; how it ended is in the controller's :class:`~specrag.controller.warmup.WarmupRecord`.
    """

    kind: str
    at: float
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class Timeline:
    """The per-query record, written only by the query's own run and never after its ``done``;
    derived figures are properties so they cannot drift from the events."""

    arrival: float
    mode: str
    events: list[TimelineEvent] = field(default_factory=list)
    embed_start: float | None = None
    search_start: float | None = None
    search_end: float | None = None
    answer_submit: float | None = None
    answer_scheduled: float | None = None
    first_token: float | None = None
    done: float | None = None
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    predicted_cached_tokens: int = 0
    predicted_beside_prefill: bool = False
    speculations: int = 0
    speculations_priced_out: int = 0  # stages whose speculation's expected gain was not above its cost
    warmups_priced_out: int = 0
    aborted_speculations: int = 0
    preempted_speculations: int = 0  # of the aborted: those a final request of another query took the slot of
    wasted_spec_prefill_tokens: int = 0
    adopted: bool = False
    warmed: bool = False
    dropped_turns: int = 0
    queued_s: float = 0.0
    controller_s: float = 0.0
    documents: list[str] = field(default_factory=list)

    def add(self, kind: str, at: float, **detail: Any) -> None:
        self.events.append(TimelineEvent(kind, at, detail))

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def retrieval_start(self) -> float | None:
        """Retrieval begins with the question's embedding (when a run recorded it), then searches."""
        return self.embed_start if self.embed_start is not None else self.search_start

    @property
    def embed_s(self) -> float | None:
        if self.embed_start is None or self.search_start is None:
            return None
        return self.search_start - self.embed_start

    @property
    def retrieval_s(self) -> float | None:
        """Embedding plus staged search."""
        start = self.retrieval_start
        if start is None or self.search_end is None:
            return None
        return self.search_end - start

    @property
    def non_overlapped_basis(self) -> str:
        """What "the answer's prefill began" means in :attr:`non_overlapped_retrieval_s`.

        ``engine_scheduled`` when the engine said when it first scheduled the answer's request,
        else ``submitted`` (the moment we handed it over; time it waited in the engine's queue
        then counts as overlap, so the figure is a lower bound).
        """
        return "engine_scheduled" if self.answer_scheduled is not None else "submitted"

    @property
    def non_overlapped_retrieval_s(self) -> float | None:
        """The part of retrieval the answer's own prefill did not overlap (RAGCache Table 3).

        From the retrieval's start (the embedding) to whichever comes first, the search's end or
        the moment the engine began the prefill of the request the answer came from (an adopted
        speculation's prefill overlaps the rest of the search). See :attr:`non_overlapped_basis`.
        """
        began = self.answer_scheduled if self.answer_scheduled is not None else self.answer_submit
        return self._not_overlapped_until(began)

    @property
    def non_overlapped_retrieval_submitted_s(self) -> float | None:
        """The same, up to the answer request's submission instead: ignores the engine's queue."""
        return self._not_overlapped_until(self.answer_submit)

    def _not_overlapped_until(self, began: float | None) -> float | None:
        start = self.retrieval_start
        if start is None or self.search_end is None or began is None:
            return None
        return max(0.0, min(self.search_end, began) - start)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form: durations in ms, events relative to arrival."""

        def ms(seconds: float | None) -> float | None:
            return None if seconds is None else round(seconds * 1000, 3)

        return {
            "mode": self.mode,
            "ttft_ms": ms(self.ttft_s),
            "e2e_ms": ms(None if self.done is None else self.done - self.arrival),
            "embed_ms": ms(self.embed_s),
            "retrieval_ms": ms(self.retrieval_s),
            "non_overlapped_retrieval_ms": ms(self.non_overlapped_retrieval_s),
            "non_overlapped_basis": self.non_overlapped_basis,
            "non_overlapped_retrieval_submitted_ms": ms(self.non_overlapped_retrieval_submitted_s),
            "queued_ms": ms(self.queued_s),
            "controller_ms": ms(self.controller_s),
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "predicted_cached_tokens": self.predicted_cached_tokens,
            "predicted_beside_prefill": self.predicted_beside_prefill,
            "speculations": self.speculations,
            "speculations_priced_out": self.speculations_priced_out,
            "warmups_priced_out": self.warmups_priced_out,
            "aborted_speculations": self.aborted_speculations,
            "preempted_speculations": self.preempted_speculations,
            "wasted_spec_prefill_tokens": self.wasted_spec_prefill_tokens,
            "adopted": self.adopted,
            "warmed": self.warmed,
            "dropped_turns": self.dropped_turns,
            "documents": list(self.documents),
            "events": [
                {"kind": event.kind, "t_ms": round((event.at - self.arrival) * 1000, 3), **event.detail}
                for event in self.events
            ],
        }
