"""What goes into a query and what comes out of it.

A :class:`RagRequest` is what a caller asks; :meth:`RagController.check
<specrag.controller.controller.RagController.check>` turns it into a :class:`CheckedRequest`
(defaults applied, limits checked, session found, question tokenized) exactly once, so a server
that checks a request before admitting it does not pay for the check again when it runs it.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from specrag.cache.layout import PromptLayout
from specrag.controller.modes import Mode
from specrag.controller.sessions import Session
from specrag.controller.speculation_policy import NO_SPECULATION, QuerySpeculation
from specrag.controller.timeline import Timeline
from specrag.pipeline.engines.protocol import Sampling
from specrag.retrieval.backends.shards.merge import ShardAnswers

__all__ = ["AnswerDelta", "AnswerDone", "CheckedRequest", "Planned", "RagRequest", "Source"]


@dataclass(frozen=True)
class RagRequest:
    """One question. ``None`` fields take the controller's defaults (decoding: greedy, no stop, the
    controller's repetition control).

    ``client`` is who asks: a session (``session_id``) answers only to the client that made it
    (:meth:`~specrag.controller.controller.RagController.create_session`)."""

    question: str
    k: int | None = None
    mode: str | None = None
    document_kv: str | None = None
    #: With ``document_kv`` turbo: the top documents prefilled fresh (tiers); None: the controller's.
    document_kv_fresh: int | None = None
    max_tokens: int | None = None
    session_id: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | Sequence[str] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    client: str | None = None
    previous_questions: tuple[str, ...] = ()
    """The questions asked before this one, oldest first, when the caller sends its conversation
    (a chat's earlier user messages); a session's own questions take their place."""
    allow_partial: bool = False
    """With a sharded index, accept the merged top-k of the shards that answer when one does not
    (the timeline's ``shards`` event names both); without it such a query fails naming the shard."""
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)


@dataclass(frozen=True)
class Planned:
    """A batch query's documents, retrieved before it runs and ordered by the batch plan
    (:mod:`specrag.controller.batch`): its run searches nothing and keeps this order."""

    rows: tuple[int, ...]  # corpus rows in retrieval rank (what the order hint tells the model)
    order: tuple[int, ...]  # the same rows in the plan's prompt order
    position: int  # where the query runs in the batch's schedule
    # The shards that answered the batch's search, when its requests accepted a partial top-k.
    shards: ShardAnswers | None = None


@dataclass(frozen=True)
class CheckedRequest:
    """A request the controller has checked: everything a query run needs, resolved."""

    #: What the caller asked, as it asked it.
    request: RagRequest
    #: Passages per prompt, within the controller's limit.
    k: int
    #: The optimisation switches the query uses.
    mode: Mode
    #: Decoding settings, checked.
    sampling: Sampling
    #: The conversation the query continues, if any.
    session: Session | None
    #: The question's tokens, which serve every prompt of the query.
    question_token_ids: tuple[int, ...]
    #: Whether the query speculates and how its launches are priced: the speculation policy's
    #: answer for this query (the one answer to "speculate now?" that a run reads).
    speculation: QuerySpeculation = NO_SPECULATION
    planned: Planned | None = None
    #: Load the system prompt's and documents' KV from the engine's store (TurboRAG).
    document_kv: bool = False
    #: Of those documents, the top ones prefilled fresh after the loaded ones (tiers).
    document_kv_fresh: int = 0
    #: Whether the stored documents' KV was computed after the system prompt.
    document_kv_after_system: bool = False


@dataclass(frozen=True)
class AnswerDelta:
    """Newly generated text and tokens of the answer."""

    text: str
    token_ids: tuple[int, ...]


class Source(NamedTuple):
    """A passage the answer was generated from: its id and title, for a reader to check."""

    id: str
    title: str


@dataclass(frozen=True)
class AnswerDone:
    """The end of an answer, with its full timeline and the prompt it was generated from."""

    text: str
    finish_reason: str | None
    timeline: Timeline
    prompt: PromptLayout
    sources: tuple[Source, ...] = ()
    """The final top-k's passages in retrieval rank order (the timeline's ``documents``)."""
