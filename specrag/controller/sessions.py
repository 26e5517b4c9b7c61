"""Multi-turn conversations: each turn's prompt continues the previous one, documents de-duplicated.

A turn's prompt is the previous turn's prompt and answer, then only the documents the
conversation has not seen yet (with location hints for the repeated ones, RAGBoost §6), then the
question. Continuing the previous prompt token for token makes the whole history a prefix-cache
hit. What a conversation holds (its turns, the documents each gave) changes only when a turn is
recorded, so a turn that fails or is abandoned leaves the session as it was; one turn runs at a
time per session. When the history no longer fits the model, the oldest turns leave the context
(:mod:`specrag.controller.conversation`), and the documents they gave count as not given.

A session belongs to the client that made it: for any other client it does not exist (the same
:class:`NotFoundError` as an unknown id), so a session id that leaks or is guessed gives no one
else the conversation, nor the power to end it. Who "a client" is, is the caller's to say (the
service: a bearer token per client, else an address).

Sessions are bounded in number, overall and per client, and expire when idle: a client at its
bound replaces its own least recently used idle session, so no client can push out another's.
At the overall bound a new session is refused (429, retry when the oldest one expires): no
session used within its idle timeout is evicted to make room for someone else's.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from specrag.cache.layout import DocId, PromptLayout
from specrag.errors import ConflictError, InvalidInputError, NotFoundError, OverloadedError, echo
from specrag.retrieval.conversational import CONVERSATION_TURNS

__all__ = ["Session", "SessionStore", "Turn"]


@dataclass(frozen=True)
class Turn:
    """One recorded turn: what it added to the conversation and the documents it gave."""

    number: int
    """1-based position in the conversation; kept when older turns leave the context."""
    tokens: tuple[int, ...]
    """Its part of the history: padding after what came before, documents, hint, question, answer."""
    documents: tuple[DocId, ...]


@dataclass
class Session:
    """One conversation: the turns still in the model's context, after the padded system prompt."""

    session_id: str
    owner: str
    base: tuple[int, ...] = ()
    """The system prompt as it starts every prompt (padded); set by the first turn."""
    context: tuple[Turn, ...] = ()
    turns: int = 0
    """Turns recorded since the session began, including those no longer in the context."""
    questions: tuple[str, ...] = ()
    """The last questions asked, oldest first: what a follow-up is searched with
    (:mod:`specrag.retrieval.conversational`), even once their turns left the context."""
    busy: bool = False
    last_used: float = field(default_factory=time.monotonic)

    @property
    def history(self) -> tuple[int, ...]:
        """Everything the next turn continues: the system prompt and the turns in the context."""
        return self.history_of(self.context)

    def history_of(self, turns: Iterable[Turn]) -> tuple[int, ...]:
        """The system prompt followed by these turns."""
        return self.base + tuple(token for turn in turns for token in turn.tokens)

    def first_given(self, turns: Iterable[Turn] | None = None) -> dict[DocId, int]:
        """The turn that gave each document still in the context (or in ``turns``)."""
        return {
            doc: turn.number for turn in (self.context if turns is None else turns) for doc in turn.documents
        }


class SessionStore:
    """Sessions by id: LRU-bounded overall and per client, expiring after ``ttl_s`` idle."""

    def __init__(
        self,
        max_sessions: int = 1000,
        ttl_s: float = 3600.0,
        max_per_client: int = 64,
        clock: Callable[[], float] = time.monotonic,
    ):
        if max_sessions < 1 or max_per_client < 1 or not ttl_s > 0:
            raise InvalidInputError("max_sessions, max_per_client and ttl_s must be positive")
        self.max_sessions = max_sessions
        self.max_per_client = max_per_client
        self.ttl_s = ttl_s
        self._clock = clock
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._by_owner: dict[str, OrderedDict[str, Session]] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def owned_by(self, owner: str) -> int:
        return len(self._by_owner.get(owner, ()))

    def create(self, owner: str) -> Session:
        """A new session for ``owner``.

        Past its own bound a client loses its own least recently used idle session, never another
        client's. Past the overall bound (expired sessions gone) the answer is
        :class:`OverloadedError`, with the time until the oldest idle session expires; so it is
        when every one of the client's own sessions has a turn in progress.
        """
        self._expire()
        mine = self._by_owner.get(owner)
        if mine is not None and len(mine) >= self.max_per_client:
            self._evict_idle(mine.values(), f"client {owner} has {len(mine)} sessions")
        elif len(self._sessions) >= self.max_sessions:
            raise OverloadedError(
                f"{len(self._sessions)} sessions are open, the limit; none has been idle for "
                f"{self.ttl_s:g} s (the idle timeout)",
                retry_after_s=self._next_expiry_s(),
            )
        session = Session(secrets.token_hex(8), owner, last_used=self._clock())
        self._sessions[session.session_id] = session
        self._by_owner.setdefault(owner, OrderedDict())[session.session_id] = session
        return session

    def get(self, session_id: str, client: str | None) -> Session:
        """``client``'s live session, or :class:`NotFoundError` (never created, expired, closed or
        another client's: the same answer, so that no one learns which ids exist)."""
        self._expire()
        session = self._owned(session_id, client)
        self._touch(session)
        return session

    def ensure_idle(self, session: Session) -> None:
        """:class:`ConflictError` while a turn of the session runs."""
        if session.busy:
            raise ConflictError(
                f"session {echo(session.session_id)} has a turn in progress; send the next turn after it"
            )

    def begin_turn(self, session: Session) -> None:
        """Claim the session for one turn: :class:`ConflictError` while another turn runs."""
        self.ensure_idle(session)
        session.busy = True

    def end_turn(self, session: Session) -> None:
        session.busy = False
        if self._sessions.get(session.session_id) is session:
            self._touch(session)

    def record_turn(
        self,
        session: Session,
        kept: Sequence[Turn],
        prompt: PromptLayout,
        answer: Sequence[int],
        question: str,
    ) -> None:
        """The turn is done: the context becomes ``kept``, then this prompt's new part and answer;
        ``question`` joins the questions a follow-up is searched with."""
        if not kept:  # the prompt starts with the system prompt: its first segment
            session.base = prompt.token_ids[: prompt.segments[0].end]
        start = len(session.base) + sum(len(turn.tokens) for turn in kept)
        session.turns += 1
        turn = Turn(session.turns, (*prompt.token_ids[start:], *answer), prompt.document_ids())
        session.context = (*kept, turn)
        session.questions = (*session.questions, question)[-CONVERSATION_TURNS:]

    def close(self, session_id: str, client: str | None) -> None:
        """End ``client``'s session; :class:`NotFoundError` as :meth:`get` says."""
        self._remove(self._owned(session_id, client))

    def _owned(self, session_id: str, client: str | None) -> Session:
        session = self._sessions.get(session_id)
        if session is None or session.owner != client:
            raise NotFoundError(f"unknown session {echo(session_id)} (never created, expired or closed)")
        return session

    def _touch(self, session: Session) -> None:
        session.last_used = self._clock()
        self._sessions.move_to_end(session.session_id)
        self._by_owner[session.owner].move_to_end(session.session_id)

    def _evict_idle(self, candidates: Iterable[Session], why: str) -> None:
        """Remove the least recently used of ``candidates`` (oldest first) with no turn in progress."""
        for session in candidates:
            if not session.busy:
                self._remove(session)
                return
        raise OverloadedError(f"{why}, each with a turn in progress")

    def _next_expiry_s(self) -> float:
        """Seconds until the least recently used idle session expires (the timeout if all run)."""
        idle = next((session for session in self._sessions.values() if not session.busy), None)
        return self.ttl_s if idle is None else max(0.0, idle.last_used + self.ttl_s - self._clock())

    def _remove(self, session: Session) -> None:
        del self._sessions[session.session_id]
        mine = self._by_owner[session.owner]
        del mine[session.session_id]
        if not mine:
            del self._by_owner[session.owner]

    def _expire(self) -> None:
        deadline = self._clock() - self.ttl_s
        expired = []
        for session in self._sessions.values():  # least recently used first
            if session.last_used >= deadline:
                break
            if not session.busy:
                expired.append(session)
        for session in expired:
            self._remove(session)
