"""One engine replica as the router sees it: its engine, its exact knowledge tree and its queue.

Each replica's tree mirrors that replica's prefix cache (fed by its own KV events), so the router
can ask every replica what it would reuse of a prompt. The replica also keeps what a TTFT
estimate needs and the engine cannot say by itself: the prefills of ours it is working on (with
their estimated cost) and a *measured* speed factor, the ratio of observed to predicted first-token
times, so a replica on a slower machine or a busier core is seen as such.

A replica that fails is excluded at once: its tree is cleared (whatever it held is gone or
unknowable) and every request of ours there is failed, so a query waiting for its first token
retries elsewhere instead of waiting for a timeout, and an answer streaming from it migrates
(:class:`~specrag.controller.flight.RetriedFlight`) instead of waiting for the engine to notice
its own death. It rejoins when the pool's health check
sees it answer again. A replica that *stalls* (an engine that accepts requests and never steps)
fails nothing by itself: the health check excludes it once none of its pending requests has had
its first token for the stall timeout beyond what the oldest was expected to take
(:meth:`Replica.stalled_for`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from specrag.cache.pgdsf import PrefillProfile
from specrag.cache.tree import KnowledgeTree
from specrag.errors import EngineError, InvalidInputError
from specrag.pipeline.engines.protocol import Engine, now

__all__ = ["Replica"]

logger = logging.getLogger(__name__)

# How fast the speed factor follows new observations, and how far one observation may move it.
_SPEED_SMOOTHING = 0.2
_SPEED_RATIO_BOUNDS = (0.2, 5.0)


@dataclass
class _Pending:
    """One request of ours waiting for its first token on this replica."""

    submitted_at: float
    predicted_s: float
    estimate_s: float
    fail: Callable[[EngineError], None]


class Replica:
    """An engine, the knowledge tree mirroring its cache, and its pending prefills (module doc)."""

    def __init__(
        self, name: str, engine: Engine, tree: KnowledgeTree, profile: PrefillProfile | None = None
    ) -> None:
        if not name:
            raise InvalidInputError("a replica needs a name")
        if tree.block_size != engine.block_size:
            raise InvalidInputError(
                f"replica {name}: tree block size {tree.block_size} differs from "
                f"the engine's {engine.block_size}"
            )
        self.name = name
        self.engine = engine
        self.tree = tree
        self.profile = profile or PrefillProfile()
        self.speed = 1.0
        self.excluded: str | None = None
        self.exclusions = 0
        self._pending: dict[str, _Pending] = {}
        self._streaming: dict[str, Callable[[EngineError], None]] = {}  # past their first token
        self._last_first_token = now()  # progress, as the stall check sees it
        self._watched_since = self._last_first_token  # silence before this is not the replica's
        # Run on every rejoin, e.g. to resubscribe a KV-event mirror to a restarted engine.
        self.rejoin_hooks: list[Callable[[], Awaitable[None]]] = []

    @classmethod
    def for_engine(cls, name: str, engine: Engine, system_token_ids: Sequence[int]) -> Replica:
        """The replica of ``engine`` with an empty tree of its block size, and its capacity model
        until KV events come; ``system_token_ids`` as the system prompt starts every prompt
        (padded to whole blocks: the engine caches, and the tree must predict, its padding too)."""
        capacity = engine.kv_capacity_tokens
        tree = KnowledgeTree(
            system_token_ids,
            block_size=engine.block_size,
            capacity_blocks=capacity // engine.block_size if capacity else None,
        )
        return cls(name, engine, tree)

    def __repr__(self) -> str:
        return f"Replica({self.name!r})"

    @property
    def available(self) -> bool:
        """Not excluded, and its supervisor (if any) has an engine in service."""
        if self.excluded is not None:
            return False
        supervision = self.engine.supervision
        return supervision is None or supervision.status().state == "ready"

    @property
    def pending(self) -> int:
        """Requests of ours waiting for their first token here."""
        return len(self._pending)

    def prefill_s(self, cached_tokens: int, prompt_tokens: int) -> float:
        """Estimated prefill time of a prompt here: the profile's cost scaled by measured speed."""
        return self.speed * self.profile.cost(cached_tokens, max(prompt_tokens - cached_tokens, 0))

    def wait_s(self) -> float:
        """Estimated prefill work ahead of a new request: what the pending ones have left."""
        at = now()
        return sum(max(p.estimate_s - (at - p.submitted_at), 0.0) for p in self._pending.values())

    def ttft_s(self, cached_tokens: int, prompt_tokens: int) -> float:
        """Estimated time to a new request's first token: the queue's work, then its own prefill."""
        return self.wait_s() + self.prefill_s(cached_tokens, prompt_tokens)

    # ------------------------------------------------------------------ bookkeeping of requests

    def submitted(
        self, request_id: str, cached_tokens: int, prompt_tokens: int, fail: Callable[[EngineError], None]
    ) -> None:
        """A request of ours went to this engine; ``fail`` ends it if the replica is excluded."""
        estimate = self.prefill_s(cached_tokens, prompt_tokens)
        self._pending[request_id] = _Pending(now(), self.wait_s() + estimate, estimate, fail)

    def first_token(self, request_id: str, at: float) -> None:
        """Its first token came: it leaves the queue, and the speed factor learns from it."""
        self._last_first_token = max(self._last_first_token, at)
        pending = self._pending.pop(request_id, None)
        if pending is not None:
            self._streaming[request_id] = pending.fail
        if pending is None or pending.predicted_s <= 0:
            return
        low, high = _SPEED_RATIO_BOUNDS
        ratio = min(max((at - pending.submitted_at) / pending.predicted_s, low), high)
        self.speed *= 1.0 - _SPEED_SMOOTHING + _SPEED_SMOOTHING * ratio

    def finished(self, request_id: str) -> None:
        """It ended (aborted, failed or done) before or after its first token."""
        self._pending.pop(request_id, None)
        self._streaming.pop(request_id, None)

    # ------------------------------------------------------------------ faults

    def stalled_for(self, timeout_s: float) -> float | None:
        """Seconds the replica has been stalled past ``timeout_s``, or None if it is not.

        Stalled: requests of ours wait for their first token here, and neither has any first
        token come for ``timeout_s`` nor has the oldest got one within its own expected time
        plus ``timeout_s`` (so a long queue the estimate foresaw is not a stall).
        """
        if not self._pending:
            return None
        at = now()
        oldest = min(self._pending.values(), key=lambda pending: pending.submitted_at)
        quiet = at - max(self._last_first_token, oldest.submitted_at, self._watched_since)
        late = at - max(oldest.submitted_at + oldest.predicted_s, self._watched_since)
        over = min(quiet, late) - timeout_s
        return over if over > 0 else None

    def excuse_pause(self) -> None:
        """Count the replica's silence from now: this process itself did not run for a while (its
        event loop blocked, or the machine descheduled it), so no first token could be seen, and
        that silence says nothing of the engine."""
        self._watched_since = now()

    def exclude(self, reason: str) -> None:
        """Take the replica out of routing, forget its cache, fail what waits on it (module doc)."""
        if self.excluded is not None:
            return
        logger.warning("replica %s excluded: %s", self.name, reason)
        self.excluded = reason
        self.exclusions += 1
        self.tree.engine_cache_cleared()
        pending, self._pending = self._pending, {}
        streaming, self._streaming = self._streaming, {}
        for fail in [*(request.fail for request in pending.values()), *streaming.values()]:
            fail(EngineError(f"replica {self.name} was excluded: {reason}"))

    async def rejoin(self) -> None:
        """Back in routing, with an empty tree: a restarted engine's cache is empty."""
        if self.excluded is None:
            return
        logger.info("replica %s rejoins", self.name)
        self.tree.engine_cache_cleared()
        for hook in self.rejoin_hooks:
            await hook()
        self.excluded = None
