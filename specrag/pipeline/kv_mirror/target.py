"""What a KV event stream feeds, and how far behind the stream the mirror is.

Free of vLLM and ZMQ, so that the mirror (and the service reading its state) need not load them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from specrag.cache.events import KVEvent

__all__ = ["MirrorLag", "MirrorTarget", "apply_batch"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MirrorTarget:
    """What a KV event stream feeds: the mirror of one engine's prefix cache.

    ``apply`` takes one batch's events in order and applies all or none of them (raising when it
    applied none); ``reset`` says the mirror follows a publisher from its batch 0 on (a new
    publisher, or the subscription joined: the tree starts empty); ``degrade`` says the stream
    lost something, with the reason: the mirror is no longer known to be exact until it is reset
    or sees the engine clear its cache; ``unsure`` says it cannot know the engine's cache although
    nothing it followed was lost (a history older than the replay buffer, a subscriber that
    stopped): no reason to empty the engine's cache.
    """

    apply: Callable[[Sequence[KVEvent]], None]
    reset: Callable[[], None]
    degrade: Callable[[str], None]
    unsure: Callable[[str], None]


@dataclass(frozen=True)
class MirrorLag:
    """How far the tree is behind the events received: ``batches`` the subscriber knows the
    publisher sent (received, or missing and being replayed) and the tree has not applied yet, and
    ``seconds`` since the oldest of those it holds was received (0 when none waits)."""

    batches: int = 0
    seconds: float = 0.0


def apply_batch(target: MirrorTarget, seq: int, events: Sequence[KVEvent]) -> bool:
    """Apply batch ``seq`` to ``target``; False, and the target degraded, when it could not be."""
    try:
        target.apply(events)
    except Exception:
        logger.exception("KV event batch %d could not be applied", seq)
        target.degrade(f"KV event batch {seq} could not be applied")
        return False
    return True
