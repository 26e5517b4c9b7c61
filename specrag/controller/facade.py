"""What a front end may ask of the query core, and nothing more.

The HTTP service holds a :class:`QueryCore`, not the controller: it answers queries, reads the
load and the engine's health, and opens and closes sessions, but cannot reach into the prefill
gate, the engine or the configuration, so the controller's inside can change without the service
noticing. :class:`~specrag.controller.controller.RagController` is the implementation.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Protocol

from specrag.controller.batch import BatchAnswers
from specrag.controller.query import AnswerDelta, AnswerDone, CheckedRequest, RagRequest
from specrag.controller.warmup import WarmupRecord
from specrag.pipeline.engines.protocol import SupervisionStatus

__all__ = ["CoreLoad", "EngineHealth", "QueryCore", "ReplicaFacts"]


@dataclass(frozen=True)
class CoreLoad:
    """Our requests in the prefill pool (no first token yet) and final ones queued for a slot."""

    prefill_pool: int
    queued: int


@dataclass(frozen=True)
class ReplicaFacts:
    """One engine replica as /health reports it: in routing or excluded (why), our requests waiting
    for their first token there, its speed factor and whether its PGDSF profile is measured."""

    name: str
    available: bool
    excluded: str | None
    pending: int
    speed: float
    profile_measured: bool


@dataclass(frozen=True)
class EngineHealth:
    """Whether the engine serves (and why not), with its supervisor's status when it has one, and
    the facts of every replica (one for a single engine)."""

    serving: bool
    reason: str | None
    supervision: SupervisionStatus | None
    replicas: tuple[ReplicaFacts, ...] = ()


class QueryCore(Protocol):
    """The query core as a front end sees it."""

    @property
    def default_mode(self) -> str:
        """The mode of a request that names none."""
        ...

    def check(self, request: RagRequest) -> CheckedRequest:
        """The request checked (cheap, before it takes a place in flight), or a 4xx-worthy error."""
        ...

    def stream(self, request: RagRequest | CheckedRequest) -> AsyncGenerator[AnswerDelta | AnswerDone, None]:
        """Answer deltas, then the done event; closing the generator early aborts the query."""
        ...

    def check_batch(self, requests: Sequence[RagRequest]) -> list[CheckedRequest]:
        """A batch's requests checked (cheap, before it takes a place in flight), or a 4xx-worthy error."""
        ...

    async def answer_batch(self, requests: Sequence[CheckedRequest]) -> BatchAnswers:
        """Answers to a checked batch, in the order asked."""
        ...

    def load(self) -> CoreLoad: ...

    async def health(self) -> EngineHealth: ...

    @property
    def warmups(self) -> WarmupRecord:
        """The system-prompt warm-ups the core ran (shared work, in no query's timeline)."""
        ...

    def create_session(self, client: str) -> str:
        """A new session's id, ``client``'s alone (who asks; the per-client session bound counts it)."""
        ...

    def close_session(self, session_id: str, client: str) -> None:
        """End ``client``'s session; :class:`~specrag.errors.NotFoundError` for an unknown id or
        another client's."""
        ...
