"""The controller's settings: defaults and limits for every query, checked once at start."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import InitVar, dataclass, field, fields

from specrag.cache.ordering import PolicyName
from specrag.controller.modes import DocumentKv, DocumentKvVariant, ModeName
from specrag.controller.sampling import NEUTRAL_PENALTIES, check_penalty
from specrag.controller.speculation_policy import SpeculationSetting
from specrag.errors import InvalidInputError, check_choice, echo
from specrag.retrieval.search.stages import DEFAULT_SCHEDULE, DEFAULT_STAGES, Schedule

__all__ = [
    "DEFAULT_INTER_TOKEN_TIMEOUT_S",
    "FALLBACK_BATCHED_TOKEN_BUDGET",
    "ControllerConfig",
    "PrefillOrder",
    "ServeFlag",
    "serve_flags",
]


class PrefillOrder(enum.StrEnum):
    """The order in which final requests waiting for the prefill pool get a slot (see
    :mod:`specrag.controller.gate`)."""

    RATIO = "ratio"
    WINDOW = "window"


DEFAULT_INTER_TOKEN_TIMEOUT_S = 10.0
"""The default bound on the wait between two tokens of an answer (the measure: docs/reliability.md)."""

FALLBACK_BATCHED_TOKEN_BUDGET = 512
"""vLLM's CPU default ``max_num_batched_tokens``: assumed only for an engine that reports none."""


@dataclass(frozen=True)
class ServeFlag:
    """How ``specrag serve`` spells a setting on its command line. The parser adds a flag for
    every field that carries one (its type, choices and default from the field) and the config's
    errors name it, so a new serve setting is one edit: its field here."""

    name: str
    help: str
    metavar: str | None = None
    limit: bool = False
    """Listed among the limits beyond which a query is turned away (else with the query options)."""


_FLAG = "serve_flag"


def _flag(flag: ServeFlag) -> dict[str, ServeFlag]:
    """The metadata of a field ``specrag serve`` takes as ``flag``."""
    return {_FLAG: flag}


@dataclass(frozen=True)
class ControllerConfig:
    """Controller settings; every field can be overridden per service (checked once, when made)."""

    #: Passages per prompt for a request that names no ``k``.
    k_default: int = 10
    #: The largest ``k`` a request may ask for.
    k_max: int = 50
    #: Search stages (speculation points); None: the index kind's default.
    num_stages: int | None = field(
        default=None,
        metadata=_flag(
            ServeFlag(
                "--stages",
                "search stages (speculation points) (default: by index kind, "
                + ", ".join(f"{stages} for {kind.upper()}" for kind, stages in DEFAULT_STAGES.items())
                + ")",
            )
        ),
    )
    #: How the stages cut the search; with ``num_stages`` None, the index kind's (retrieval/search/stages.py).
    stage_schedule: Schedule = field(
        default=DEFAULT_SCHEDULE,
        metadata=_flag(
            ServeFlag(
                "--stage-schedule",
                "how the stages cut the search: equal slices, or geometric (1/32, 1/16, 1/8, 1/4, 1/2, "
                "1 of it for 6 stages: the first speculation starts early) (default: %(default)s)",
            )
        ),
    )
    #: Final prompts the prefill pool holds per engine; None follows from ``batched_token_budget``.
    max_prefill_bs: int | None = field(
        default=None,
        metadata=_flag(ServeFlag("--max-prefill-bs", "prefill pool size (default: from the token budget)")),
    )
    #: How long a final request may wait in the pool's queue before it goes first (RAGCache 5.2).
    starvation_window_s: float = 2.0
    #: How a prompt's documents are ordered for the prefix cache (:mod:`specrag.cache.ordering`).
    ordering_policy: PolicyName = PolicyName.EXACT
    #: RAGBoost's order hint (the retrieval ranking, in words) on a prompt whose documents ordering
    #: moved; off because the default model answered less often right with it (docs/quality.md).
    order_hint: bool = field(
        default=False,
        metadata=_flag(
            ServeFlag(
                "--order-hint",
                "when ordering for the prefix cache changed the documents' order, tell the model their "
                "retrieval ranking (RAGBoost's order hint); off by default: it cost the default model "
                "accuracy (docs/quality.md)",
            )
        ),
    )
    #: The optimisation mode of a request that names none (:mod:`specrag.controller.modes`); a mode's
    #: name is accepted too (experiments keep tables of them) and becomes its member when checked.
    mode: ModeName | str = field(
        default=ModeName.ALL, metadata=_flag(ServeFlag("--mode", "default optimisation mode"))
    )
    #: The document KV of a request that names none.
    document_kv: DocumentKv = DocumentKv.FULL
    #: How the stored document KV of ``turbo`` requests is computed. The default of this and of
    #: ``document_kv_fresh`` is the point ``bench.pipeline.turbo``'s frontier chose (docs/turbo.md,
    #: "Frontier"): a constant copied from a measured run, to be updated when it is rerun.
    document_kv_variant: DocumentKvVariant = field(
        default=DocumentKvVariant.ALONE,
        metadata=_flag(
            ServeFlag(
                "--document-kv-variant",
                "with --document-kv turbo: each document's stored KV computed alone or after the system "
                "prompt (default: %(default)s; docs/turbo.md)",
            )
        ),
    )
    #: Tiers: a ``turbo`` request's top ``document_kv_fresh`` documents (capped at its k) are
    #: prefilled fresh, after the loaded ones and nearest the question; a request may say its own.
    document_kv_fresh: int = field(
        default=1,
        metadata=_flag(
            ServeFlag(
                "--document-kv-fresh",
                "with --document-kv turbo: the top M documents prefilled fresh after the loaded ones, "
                "nearest the question; requests choose with document_kv_fresh (default: %(default)s; "
                "docs/turbo.md)",
                metavar="M",
            )
        ),
    )
    #: Tokens generated for a request that names no ``max_tokens``.
    max_tokens_default: int = 64
    #: The largest ``max_tokens`` a request may ask for.
    max_tokens_limit: int = 1024
    #: The repetition control of a request that sets none, on engines that apply penalties
    #: (:mod:`specrag.controller.sampling`); the defaults are the setting ``bench.quality.decoding``
    #: chose on the default model (docs/architecture.md, "Decoding"): constants copied from a
    #: measured run, to be updated when it is rerun.
    repetition_penalty: float = field(
        default=1.0,
        metadata=_flag(
            ServeFlag(
                "--repetition-penalty",
                "vLLM's repetition penalty of an answer whose request sets none (1: none; default "
                "%(default)s, docs/architecture.md)",
                metavar="P",
            )
        ),
    )
    frequency_penalty: float = field(
        default=1.5,
        metadata=_flag(
            ServeFlag(
                "--frequency-penalty",
                "OpenAI's frequency penalty of an answer whose request sets none (-2 to 2; default "
                "%(default)s, docs/architecture.md)",
                metavar="P",
            )
        ),
    )
    presence_penalty: float = field(
        default=0.0,
        metadata=_flag(
            ServeFlag(
                "--presence-penalty",
                "OpenAI's presence penalty of an answer whose request sets none (-2 to 2; default "
                "%(default)s)",
                metavar="P",
            )
        ),
    )
    #: No first token this long after the answer's prompt went to the engine: the query fails. It
    #: is retried only on another replica or an engine its supervisor replaced (it had hung); a
    #: working engine that did not finish the prefill in time is not asked again. A final request
    #: also waits at most this long for a prefill slot (then 504 too).
    first_token_timeout_s: float = field(
        default=60.0,
        metadata=_flag(
            ServeFlag(
                "--first-token-timeout",
                "no first token this long after the prompt went to the engine: 504; retried only on another "
                "or a restarted engine, never on the same working one (default %(default)s)",
                metavar="SECONDS",
                limit=True,
            )
        ),
    )
    #: No next token for this long: the stream has stalled; its engine request is aborted and the
    #: answer moves to another replica (or a recovered engine) like one whose engine died, or ends
    #: with an error. A few times the longest engine step measured here (docs/reliability.md).
    inter_token_timeout_s: float = field(
        default=DEFAULT_INTER_TOKEN_TIMEOUT_S,
        metadata=_flag(
            ServeFlag(
                "--inter-token-timeout",
                "no next token of an answer by then: the stream moves to another replica or a "
                "recovered engine, or ends with an error event (default %(default)s)",
                metavar="SECONDS",
                limit=True,
            )
        ),
    )
    #: Final requests that may wait for the prefill pool; more are turned away.
    max_queue: int = field(
        default=256,
        metadata=_flag(
            ServeFlag(
                "--max-queue",
                "final prompts waiting for the engine's prefill pool (default %(default)s)",
                limit=True,
            )
        ),
    )
    #: Prompt tokens the engine computes per step, from which the default ``max_prefill_bs``
    #: follows; None reads it from the engine, which an HTTP server does not report: then
    #: :data:`FALLBACK_BATCHED_TOKEN_BUDGET` is assumed and logged.
    batched_token_budget: int | None = None
    #: Caps the uncomputed prompt tokens of speculations in flight (:mod:`specrag.controller.gate`);
    #: None is one engine step per replica.
    speculative_token_budget: int | None = None
    #: The order in which final requests waiting for the prefill pool get a slot: ``"ratio"``
    #: (RAGCache's cached/compute queue) or ``"window"`` (request and document order chosen
    #: together over the oldest ``window_requests``; one engine only).
    prefill_order: PrefillOrder = PrefillOrder.RATIO
    #: The requests a ``"window"`` order plans over at once.
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
    speculation: SpeculationSetting = field(
        default=SpeculationSetting.AUTO,
        metadata=_flag(
            ServeFlag(
                "--speculation",
                "speculative prefill on a running top-k: auto launches one (or a system-prompt warm-up) "
                "only when its expected gain, from measured figures, exceeds its expected cost; always "
                "whenever the prefill pool has room; never (default: %(default)s; see docs/speculation.md)",
            )
        ),
    )
    #: The questions one batch may hold (:mod:`specrag.controller.batch`).
    max_batch_queries: int = 32

    #: How the caller spelled each setting (a command line's flags, say), for its errors; a setting
    #: not in it is named as its field. Not kept: only the check reads it.
    names: InitVar[Mapping[str, str] | None] = None

    def __post_init__(self, names: Mapping[str, str] | None) -> None:
        """Checked once, when made: a config that exists is valid, its closed choices resolved to
        their Enum members (a string that spells one is accepted, as JSON and a command line give it)."""
        spelled = {**_SPOKEN, **(names or {})}

        def name(setting: str) -> str:
            return spelled.get(setting, setting)

        for setting, choices in _CHOICES.items():
            resolved = check_choice(name(setting), getattr(self, setting), choices)
            object.__setattr__(self, setting, resolved)
        if not 1 <= self.k_default <= self.k_max:
            raise InvalidInputError(f"{name('k_default')} must be between 1 and {name('k_max')}")
        self.check_fresh(self.document_kv_fresh, self.k_max, name("document_kv_fresh"))
        at_least_one = {
            "num_stages": self.num_stages,
            "max_prefill_bs": self.max_prefill_bs,
            "batched_token_budget": self.batched_token_budget,
            "speculative_token_budget": self.speculative_token_budget,
            "max_batch_queries": self.max_batch_queries,
            "window_requests": self.window_requests,
        }
        for setting, value in at_least_one.items():
            if value is not None and value < 1:
                raise InvalidInputError(f"{name(setting)} must be at least 1")
        if not 1 <= self.max_tokens_default <= self.max_tokens_limit:
            raise InvalidInputError(
                f"{name('max_tokens_default')} must be between 1 and {name('max_tokens_limit')}"
            )
        for penalty in NEUTRAL_PENALTIES:
            check_penalty(penalty, getattr(self, penalty), name(penalty))
        if self.max_queue < 0:
            raise InvalidInputError(f"{name('max_queue')} cannot be negative")
        for timeout in ("first_token_timeout_s", "inter_token_timeout_s"):
            if not getattr(self, timeout) > 0:  # written so that NaN fails too
                raise InvalidInputError(f"{name(timeout)} must be positive")
        if not self.starvation_window_s >= 0:
            raise InvalidInputError(f"{name('starvation_window_s')} cannot be negative")

    @property
    def default_penalties(self) -> dict[str, float]:
        """The repetition control a request that sets none gets (where engines apply penalties)."""
        return {penalty: getattr(self, penalty) for penalty in NEUTRAL_PENALTIES}

    def check_k(self, k: object, name: str = "k") -> int:
        """``k`` when it is an integer from 1 to ``k_max``, else :class:`InvalidInputError` naming
        it ``name``: the one check of the range, for a request and for a command line that wants
        to fail before it starts a service."""
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= self.k_max:
            raise InvalidInputError(f"{name} must be an integer between 1 and {self.k_max}, got {echo(k)}")
        return k

    @staticmethod
    def check_fresh(fresh: object, k: int, name: str = "document_kv_fresh") -> int:
        """``fresh`` when it is an integer from 0 to ``k`` (the documents a request has), else
        :class:`InvalidInputError` naming it ``name``."""
        if isinstance(fresh, bool) or not isinstance(fresh, int) or not 0 <= fresh <= k:
            raise InvalidInputError(f"{name} must be an integer between 0 and {k}, got {echo(fresh)}")
        return fresh


def serve_flags() -> dict[str, ServeFlag]:
    """The settings ``specrag serve`` takes, by field name, in the fields' order."""
    return {
        setting.name: setting.metadata[_FLAG]
        for setting in fields(ControllerConfig)
        if _FLAG in setting.metadata
    }


# Settings that Python callers have always seen named in words (the retrieval and cache packages' own names).
_SPOKEN = {"stage_schedule": "stage schedule", "ordering_policy": "ordering policy"}

# The Enum of each closed setting: a spelling given (JSON, a command line) becomes its member when checked.
_CHOICES: dict[str, type[enum.StrEnum]] = {
    "stage_schedule": Schedule,
    "ordering_policy": PolicyName,
    "mode": ModeName,
    "document_kv": DocumentKv,
    "document_kv_variant": DocumentKvVariant,
    "prefill_order": PrefillOrder,
    "speculation": SpeculationSetting,
}
