"""What happened to one query, and when: the record every latency figure is computed from.

Times are ``time.perf_counter()`` seconds; the exported form gives milliseconds relative to the
query's arrival so a timeline can be plotted or compared across processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class TimelineEvent:
    """One step: ``kind`` is stage, warmup_start, spec_submit, spec_abort, spec_skip (a running
    top-k's prompt too long for the model), history_dropped (a conversation's oldest turns left
    the context), adopt, queued, final_submit, retry, first_token or done.

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
    search_start: float | None = None
    search_end: float | None = None
    answer_submit: float | None = None
    first_token: float | None = None
    done: float | None = None
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    predicted_cached_tokens: int = 0
    speculations: int = 0
    aborted_speculations: int = 0
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
    def retrieval_s(self) -> float | None:
        if self.search_start is None or self.search_end is None:
            return None
        return self.search_end - self.search_start

    @property
    def non_overlapped_retrieval_s(self) -> float | None:
        """The part of the search the answer's own prefill did not overlap (RAGCache Table 3).

        From the search's start to whichever comes first, its end or the submission of the prompt
        the answer came from (an adopted speculation's submission overlaps the rest of the search).
        """
        if self.search_start is None or self.search_end is None or self.answer_submit is None:
            return None
        return max(0.0, min(self.search_end, self.answer_submit) - self.search_start)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form: durations in ms, events relative to arrival."""

        def ms(seconds: float | None) -> float | None:
            return None if seconds is None else round(seconds * 1000, 3)

        return {
            "mode": self.mode,
            "ttft_ms": ms(self.ttft_s),
            "e2e_ms": ms(None if self.done is None else self.done - self.arrival),
            "retrieval_ms": ms(self.retrieval_s),
            "non_overlapped_retrieval_ms": ms(self.non_overlapped_retrieval_s),
            "queued_ms": ms(self.queued_s),
            "controller_ms": ms(self.controller_s),
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "predicted_cached_tokens": self.predicted_cached_tokens,
            "speculations": self.speculations,
            "aborted_speculations": self.aborted_speculations,
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
