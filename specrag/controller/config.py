"""The controller's settings: defaults and limits for every query, checked once at start."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from specrag.cache.ordering import PolicyName, get_policy
from specrag.controller.modes import ModeName, check_document_kv, get_mode
from specrag.controller.speculation_policy import check_speculation
from specrag.errors import InvalidInputError, check_choice
from specrag.retrieval.stages import DEFAULT_SCHEDULE, Schedule, check_schedule

Admission = Literal["ratio", "window"]
ADMISSIONS: tuple[Admission, ...] = get_args(Admission)
"""How final requests waiting for the prefill pool are admitted (see :mod:`specrag.controller.gate`)."""

FALLBACK_BATCHED_TOKEN_BUDGET = 512
"""vLLM's CPU default ``max_num_batched_tokens``: assumed only for an engine that reports none."""


@dataclass(frozen=True)
class ControllerConfig:
    """Controller settings; every field can be overridden per service (checked once, when made)."""

    #: Passages per prompt for a request that names no ``k``.
    k_default: int = 10
    #: The largest ``k`` a request may ask for.
    k_max: int = 50
    #: Search stages (speculation points); None: the index kind's default.
    num_stages: int | None = None
    #: How the stages cut the search; with ``num_stages`` None, the index kind's (retrieval/stages.py).
    stage_schedule: Schedule = DEFAULT_SCHEDULE
    #: Final prompts the prefill pool holds per engine; None follows from ``batched_token_budget``.
    max_prefill_bs: int | None = None
    #: How long a final request may wait in the pool's queue before it goes first (RAGCache 5.2).
    starvation_window_s: float = 2.0
    #: How a prompt's documents are ordered for the prefix cache (:mod:`specrag.cache.ordering`).
    ordering_policy: PolicyName = "exact"
    #: RAGBoost's order hint (the retrieval ranking, in words) on a prompt whose documents ordering
    #: moved; off because the default model answered less often right with it (docs/quality.md).
    order_hint: bool = False
    #: The optimisation mode of a request that names none (:mod:`specrag.controller.modes`).
    mode: ModeName = "all"
    #: The document KV of a request that names none (see modes.DOCUMENT_KV_CHOICES).
    document_kv: str = "full"
    #: Tokens generated for a request that names no ``max_tokens``.
    max_tokens_default: int = 64
    #: The largest ``max_tokens`` a request may ask for.
    max_tokens_limit: int = 1024
    #: No first token by then: the query fails (after one retry on a fresh engine).
    first_token_timeout_s: float = 60.0
    #: Final requests that may wait for the prefill pool; more are turned away.
    max_queue: int = 256
    #: Prompt tokens the engine computes per step, from which the default ``max_prefill_bs``
    #: follows; None reads it from the engine, which an HTTP server does not report: then
    #: :data:`FALLBACK_BATCHED_TOKEN_BUDGET` is assumed and logged.
    batched_token_budget: int | None = None
    #: Caps the uncomputed prompt tokens of speculations in flight (:mod:`specrag.controller.gate`);
    #: None is one engine step per replica.
    speculative_token_budget: int | None = None
    #: How final requests waiting for the prefill pool are admitted: ``"ratio"`` (RAGCache's
    #: cached/compute queue) or ``"window"`` (request and document order chosen together over the
    #: oldest ``window_requests``; one engine only).
    admission: Admission = "ratio"
    #: The requests a ``"window"`` admission plans over at once.
    window_requests: int = 16
    #: Sessions open at once, all clients (the three session bounds are checked by the session store).
    max_sessions: int = 1000
    #: Sessions open at once from one client.
    max_sessions_per_client: int = 64
    #: A session unused this long is closed.
    session_ttl_s: float = 3600.0
    #: Whether a mode that speculates prices each speculative prefill and warm-up first
    #: (``"auto"``), launches them whenever the gate has room (``"always"``, the behaviour before
    #: pricing) or never speculates (``"never"``); see :mod:`specrag.controller.speculation_policy`.
    speculation: str = "auto"
    #: The questions one batch may hold (:mod:`specrag.controller.batch`).
    max_batch_queries: int = 32

    def __post_init__(self) -> None:
        """Checked once, when made: a config that exists is valid (flag names: see serve)."""
        self.validate()

    def validate(self) -> ControllerConfig:
        """Raise :class:`InvalidInputError` for a bad setting; the config itself otherwise."""
        get_mode(self.mode)
        check_document_kv(self.document_kv)
        get_policy(self.ordering_policy)
        if not 1 <= self.k_default <= self.k_max:
            raise InvalidInputError("k_default must be between 1 and k_max")
        if self.num_stages is not None and self.num_stages < 1:
            raise InvalidInputError("num_stages must be at least 1")
        check_schedule(self.stage_schedule)
        check_speculation(self.speculation)
        if self.max_prefill_bs is not None and self.max_prefill_bs < 1:
            raise InvalidInputError("max_prefill_bs must be at least 1")
        if not 1 <= self.max_tokens_default <= self.max_tokens_limit:
            raise InvalidInputError("max_tokens_default must be between 1 and max_tokens_limit")
        if self.batched_token_budget is not None and self.batched_token_budget < 1:
            raise InvalidInputError("batched_token_budget must be at least 1")
        if self.speculative_token_budget is not None and self.speculative_token_budget < 1:
            raise InvalidInputError("speculative_token_budget must be at least 1")
        check_choice("admission", self.admission, ADMISSIONS)
        if self.max_batch_queries < 1:
            raise InvalidInputError("max_batch_queries must be at least 1")
        if self.window_requests < 1:
            raise InvalidInputError("window_requests must be at least 1")
        if self.max_queue < 0:
            raise InvalidInputError("max_queue cannot be negative")
        if not self.first_token_timeout_s > 0:  # written so that NaN fails too
            raise InvalidInputError("first_token_timeout_s must be positive")
        if not self.starvation_window_s >= 0:
            raise InvalidInputError("starvation_window_s cannot be negative")
        return self
