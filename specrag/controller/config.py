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
    """Controller settings; every field can be overridden per service.

    ``max_sessions``, ``max_sessions_per_client`` and ``session_ttl_s`` bound the session store
    (checked where it is built).
    ``batched_token_budget`` (prompt tokens the engine computes per step, from which the default
    ``max_prefill_bs`` follows) is None to read it from the engine's own configuration; it needs
    setting only for an engine that does not report it (an HTTP server), else
    :data:`FALLBACK_BATCHED_TOKEN_BUDGET` is assumed and logged.
    ``speculative_token_budget`` caps the uncomputed prompt tokens of speculations in flight
    (see :mod:`specrag.controller.gate`); None is one engine step per replica.
    ``admission`` orders final requests waiting for the prefill pool: ``"ratio"`` (RAGCache's
    cached/compute queue) or ``"window"`` (request and document order chosen together over the
    oldest ``window_requests``; one engine only).
    ``max_batch_queries`` bounds the questions of one batch (:mod:`specrag.controller.batch`).
    ``speculation`` says whether a mode that speculates prices each speculative prefill and
    warm-up first (``"auto"``), launches them whenever the gate has room (``"always"``, the
    behaviour before pricing) or never speculates (``"never"``); see
    :mod:`specrag.controller.speculation_policy`.
    ``order_hint`` adds RAGBoost's order hint (the retrieval ranking, in words) to a prompt whose
    documents ordering moved; off by default because the default model answered less often right
    with it (docs/quality.md).
    """

    k_default: int = 10
    k_max: int = 50
    num_stages: int | None = None  # None: the index kind's default
    stage_schedule: Schedule = DEFAULT_SCHEDULE  # and num_stages None: the index kind's (retrieval/stages.py)
    max_prefill_bs: int | None = None
    starvation_window_s: float = 2.0
    ordering_policy: PolicyName = "exact"
    order_hint: bool = False  # the default model reads a reordered prompt better without it
    mode: ModeName = "all"
    document_kv: str = "full"  # the default of requests that do not say (see modes.DOCUMENT_KV_CHOICES)
    max_tokens_default: int = 64
    max_tokens_limit: int = 1024
    first_token_timeout_s: float = 60.0
    max_queue: int = 256
    batched_token_budget: int | None = None
    speculative_token_budget: int | None = None
    admission: Admission = "ratio"
    window_requests: int = 16
    max_sessions: int = 1000
    max_sessions_per_client: int = 64
    session_ttl_s: float = 3600.0
    speculation: str = "auto"
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
