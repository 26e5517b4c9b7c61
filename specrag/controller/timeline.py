"""What happened to one query, and when: the record every latency figure is computed from.

Times are ``time.perf_counter()`` seconds; the exported form gives milliseconds relative to the
query's arrival so a timeline can be plotted or compared across processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["EventKind", "Timeline", "TimelineEvent"]

EventKind = Literal[
    "conversation",
    "planned",
    "unstaged",
    "stage",
    "shards",
    "warmup_start",
    "warmup_skip",
    "spec_submit",
    "spec_abort",
    "spec_skip",
    "history_dropped",
    "adopt",
    "queued",
    "reordered",
    "final_submit",
    "route",
    "retry",
    "migrate",
    "first_token",
    "done",
]
"""Every kind of event a timeline records (:class:`TimelineEvent` says what each means)."""


@dataclass(frozen=True)
class TimelineEvent:
    """One step of a query, ``kind`` one of :data:`EventKind`:

    - ``conversation``: a follow-up was searched with the ``questions`` asked before it
      (:mod:`specrag.retrieval.conversational`);
    - ``planned``: a batch query starts with the documents its batch retrieved and ordered
      (``position`` in the batch's schedule; no search of its own);
    - ``unstaged``: the search ran in one stage, since no stage was expected to launch a speculation
      (the best stage's price, :meth:`~specrag.controller.speculation_policy.SpeculationPolicy.unstaged`);
    - ``stage``: a search stage's running top-k arrived (``done`` for the final one);
    - ``shards``: a search that accepted a partial top-k (``allow_partial``) ended: the shards that
      ``answered``, and those ``missing`` with why;
    - ``warmup_start``: the query started warming the system prompt; ``warmup_skip``: its price
      said it would not pay;
    - ``spec_submit``, ``spec_abort`` (``reason`` stale or preempted), ``spec_skip`` (``reason``:
      ``too_long``, a running top-k's prompt too long for the model; ``price``, its expected gain
      not above its expected cost; ``no_room``, the prefill gate refused): speculations. A priced
      decision (spec_submit, spec_skip for its price, warmup_start, warmup_skip) carries the
      price's figures (:meth:`~specrag.controller.speculation_policy.Price.detail`);
    - ``history_dropped``: a conversation's oldest turns left the context;
    - ``adopt``: the final prompt was the speculation's, whose stream becomes the answer;
    - ``queued``: the final prompt waits for a prefill slot; ``reordered``: the window order
      chose another document order when it gave it a slot;
    - ``final_submit``, ``route`` (which replica, and why);
    - ``retry``: the answer's request failed before its first token and was submitted again;
      ``migrate``: it failed after it (or stalled: no token for the inter-token timeout), and
      the prompt plus the ``tokens_sent`` went ``to`` another replica, the stream going on;
    - ``first_token``, ``done``.

    A warm-up the query triggered is shared work that may outlive it: the query notes only its
    start; how it ended is in the controller's :class:`~specrag.controller.warmup.WarmupRecord`.
    """

    kind: EventKind
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
    # The answering request's way to its first token, as the engine stamped it (None where it
    # does not say) and as our adapter received it: see :attr:`phases`.
    answer_queued: float | None = None
    answer_scheduled: float | None = None
    answer_engine_first_token: float | None = None
    answer_received: float | None = None
    # Our requests in the engine when the answering one was submitted (a speculation, a warm-up).
    answer_beside: dict[str, int] = field(default_factory=dict)
    first_token: float | None = None
    done: float | None = None
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    document_kv_tokens: int = 0  # of the cached tokens, those loaded from the document KV store
    predicted_cached_tokens: int = 0
    predicted_beside_prefill: bool = False
    speculations: int = 0
    speculations_priced_out: int = 0  # stages whose speculation did not pay, or would pay more later
    warmups_priced_out: int = 0
    aborted_speculations: int = 0
    preempted_speculations: int = 0  # of the aborted: those a final request of another query took the slot of
    wasted_spec_prefill_tokens: int = 0
    adopted: bool = False
    warmed: bool = False
    dropped_turns: int = 0
    migrations: int = 0  # moves of the answer to another replica after its first token
    queued_s: float = 0.0
    controller_s: float = 0.0
    documents: list[str] = field(default_factory=list)

    def add(self, kind: EventKind, at: float, **detail: Any) -> None:
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

    @property
    def search_s(self) -> float | None:
        """The staged search alone (retrieval less the embedding); None without one (a batch
        query, whose batch searched for it)."""
        if self.search_start is None or self.search_end is None:
            return None
        return self.search_end - self.search_start

    @property
    def answer_prefill_s(self) -> float | None:
        """The answer's prefill: from when the engine scheduled it (its submission where the engine
        does not say) to when the engine produced its first token (when our adapter received it
        where the engine does not stamp that). Cached prompt tokens shorten it, as they shorten
        what an overlap can hide."""
        began = self.answer_scheduled if self.answer_scheduled is not None else self.answer_submit
        ended = self.answer_engine_first_token
        if ended is None:
            ended = self.answer_received if self.answer_received is not None else self.first_token
        if began is None or ended is None or ended <= began:
            return None
        return ended - began

    @property
    def regime_r(self) -> float | None:
        """This query's r: its retrieval time (the question's embedding and the search) over its
        answer's prefill time. Overlapping the two can save at most the shorter, so it pays most
        near r = 1 and little far below it (where what helps is ordering for prefix reuse, the
        warm-up and batching). The embedding counts: a contextual embedder's pass is part of
        what the answer waits for before its documents are known, as the search is."""
        retrieval, prefill = self.retrieval_s, self.answer_prefill_s
        if self.search_s is None or retrieval is None or prefill is None:
            return None
        return retrieval / prefill

    @property
    def phases(self) -> dict[str, Any]:
        """Where the answer's time to first token went after the search, in ms (None: unknown).

        The answering request's way, each step from the one before: ``search_end_to_submit``
        (negative when an adopted speculation was submitted before the search ended),
        ``submit_to_queued`` (our hand-over to the engine's queue), ``queued_to_scheduled`` (its
        wait there, e.g. behind a stale speculation's step), ``scheduled_to_engine_first_token``
        (its prefill, in steps shared with whatever else the engine ran), ``engine_to_received``
        (the token's way back to our adapter) and ``received_to_seen`` (until this query saw it:
        queue hops, or, for a speculation that finished early, the rest of the search).
        ``beside_at_submit`` is what else of ours the engine held at submission;
        ``aborted_before_submit`` the speculations this query aborted before it, whose last step
        may still run when it arrives.
        """
        way = (
            self.search_end,
            self.answer_submit,
            self.answer_queued,
            self.answer_scheduled,
            self.answer_engine_first_token,
            self.answer_received,
            self.first_token,
        )
        names = (
            "search_end_to_submit",
            "submit_to_queued",
            "queued_to_scheduled",
            "scheduled_to_engine_first_token",
            "engine_to_received",
            "received_to_seen",
        )
        steps = {
            f"{name}_ms": None if start is None or end is None else round((end - start) * 1000, 3)
            for name, start, end in zip(names, way[:-1], way[1:], strict=True)
        }
        submit = self.answer_submit
        aborted = [e for e in self.events if e.kind == "spec_abort" and submit is not None and e.at <= submit]
        return {
            **steps,
            "beside_at_submit": dict(self.answer_beside),
            "aborted_before_submit": len(aborted),
        }

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
            "phases": self.phases,
            "search_ms": ms(self.search_s),
            "answer_prefill_ms": ms(self.answer_prefill_s),
            "regime_r": None if self.regime_r is None else round(self.regime_r, 4),
            "queued_ms": ms(self.queued_s),
            "controller_ms": ms(self.controller_s),
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "document_kv_tokens": self.document_kv_tokens,
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
            "migrations": self.migrations,
            "documents": list(self.documents),
            "events": [
                {"kind": event.kind, "t_ms": round((event.at - self.arrival) * 1000, 3), **event.detail}
                for event in self.events
            ],
        }
