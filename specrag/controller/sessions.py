"""Multi-turn conversations: each turn's prompt continues the previous one, documents de-duplicated.

A turn's prompt is the previous turn's prompt and answer, then only the documents the
conversation has not seen yet (with location hints for the repeated ones, RAGBoost §6), then the
question. Continuing the previous prompt token for token makes the whole history a prefix-cache
hit. Sessions are bounded in number and expire when idle, so memory stays bounded.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from specrag.cache.hints import Dedup, SessionDeduplicator
from specrag.cache.layout import DocId
from specrag.errors import InvalidInputError, NotFoundError


@dataclass
class Session:
    """One conversation: the token IDs of everything said so far."""

    session_id: str
    history: tuple[int, ...] = ()
    turns: int = 0
    last_used: float = field(default_factory=time.monotonic)


class SessionStore:
    """Sessions by id, LRU-bounded and expiring after ``ttl_s`` of inactivity."""

    def __init__(
        self, max_sessions: int = 1000, ttl_s: float = 3600.0, clock: Callable[[], float] = time.monotonic
    ):
        if max_sessions < 1 or ttl_s <= 0:
            raise InvalidInputError("max_sessions and ttl_s must be positive")
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self._clock = clock
        self._sessions: OrderedDict[str, Session] = OrderedDict()
        self._dedup = SessionDeduplicator(max_sessions=max_sessions)

    def __len__(self) -> int:
        return len(self._sessions)

    def create(self) -> Session:
        self._expire()
        session = Session(secrets.token_hex(8), last_used=self._clock())
        self._sessions[session.session_id] = session
        if len(self._sessions) > self.max_sessions:
            dropped, _ = self._sessions.popitem(last=False)
            self._dedup.end(dropped)
        return session

    def get(self, session_id: str) -> Session:
        """The live session, or :class:`NotFoundError` (never created, expired or closed)."""
        self._expire()
        session = self._sessions.get(session_id)
        if session is None:
            raise NotFoundError(f"unknown session {session_id!r} (never created, expired or closed)")
        self._sessions.move_to_end(session_id)
        session.last_used = self._clock()
        return session

    def dedup(self, session: Session, doc_ids: Sequence[DocId]) -> Dedup:
        """Split a turn's documents into new ones and ones already in the conversation."""
        return self._dedup.dedup(session.session_id, doc_ids)

    def record_turn(self, session: Session, prompt: Sequence[int], answer: Sequence[int]) -> None:
        session.history = (*prompt, *answer)
        session.turns += 1

    def close(self, session_id: str) -> None:
        if self._sessions.pop(session_id, None) is None:
            raise NotFoundError(f"unknown session {session_id!r}")
        self._dedup.end(session_id)

    def _expire(self) -> None:
        deadline = self._clock() - self.ttl_s
        while self._sessions:
            oldest_id, oldest = next(iter(self._sessions.items()))
            if oldest.last_used >= deadline:
                break
            self._sessions.popitem(last=False)
            self._dedup.end(oldest_id)
