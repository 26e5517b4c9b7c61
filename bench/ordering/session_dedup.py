"""Multi-turn de-duplication over a whole trace, for the ordering benchmark (``dedup_savings``).

Out of the product: a live conversation records its documents only when a turn ends
(:mod:`specrag.controller.sessions`, with :func:`specrag.cache.hints.split_repeated`); a trace
counts every turn as sent the moment it is split.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from specrag.cache.hints import Dedup, HintConfig, split_repeated
from specrag.cache.layout import DocId
from specrag.errors import InvalidInputError


class SessionDeduplicator:
    """Per-conversation record of documents already sent, bounded to ``max_sessions`` (LRU).

    For traces where every turn counts as sent the moment it is split (the ordering benchmark); a
    live conversation records its documents only when a turn ends (see the controller's sessions).
    """

    def __init__(self, config: HintConfig | None = None, max_sessions: int = 10_000) -> None:
        if max_sessions <= 0:
            raise InvalidInputError("max_sessions must be positive")
        self.config = config or HintConfig()
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, tuple[int, dict[DocId, int]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sessions)

    def dedup(self, conversation: str, doc_ids: Sequence[DocId]) -> Dedup:
        """Split this turn's documents and register the new ones for the turns that follow."""
        turns, seen = self._sessions.pop(conversation, (0, {}))
        turn = turns + 1
        result = split_repeated(seen, doc_ids, self.config)
        seen.update(dict.fromkeys(result.kept, turn))
        self._sessions[conversation] = (turn, seen)
        if len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)
        return result

    def end(self, conversation: str) -> None:
        """Forget a finished conversation."""
        self._sessions.pop(conversation, None)
