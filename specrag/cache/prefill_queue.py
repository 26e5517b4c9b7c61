"""The order in which final requests waiting for the engine's prefill pool get a slot (RAGCache §5.2).

When more requests wait than the engine's prefill pool takes, serving those with much cached
prefix and little to compute first raises the hit rate: their KV is reused before it can be
evicted, and short computations displace little. Ratio order alone can starve a request with
nothing cached, so a request that has waited longer than the starvation window goes next.

:class:`RatioQueue` ranks by the ratio predicted when a request was queued;
:class:`WindowScheduler` decides when a slot frees, against the tree as it is then, which of the
oldest waiting requests goes next and in which document order, so that the requests after it
find what it leaves cached.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from specrag.cache.layout import DocId
from specrag.cache.ordering import ExactOrder, Ordering
from specrag.cache.tree import KnowledgeTree
from specrag.errors import InvalidInputError

__all__ = ["RatioQueue", "WindowScheduler"]

T = TypeVar("T")


@dataclass(order=True)
class _Entry(Generic[T]):
    neg_priority: float
    seq: int
    enqueued: float = field(compare=False)
    request: T = field(compare=False)
    taken: bool = field(default=False, compare=False)


class RatioQueue(Generic[T]):
    """Pop the highest cached/compute ratio, unless the oldest waited past ``starvation_window_s``.

    Ties go to the earlier request. ``clock`` is injectable so tests need not sleep.
    """

    def __init__(self, starvation_window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if starvation_window_s < 0:
            raise InvalidInputError("the starvation window cannot be negative")
        self.starvation_window_s = starvation_window_s
        self._clock = clock
        self._heap: list[_Entry[T]] = []
        self._fifo: deque[_Entry[T]] = deque()
        self._seq = itertools.count()
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def push(self, request: T, cached_tokens: int, compute_tokens: int) -> None:
        if cached_tokens < 0 or compute_tokens < 0:
            raise InvalidInputError("token counts cannot be negative")
        priority = cached_tokens / max(compute_tokens, 1)
        entry = _Entry(-priority, next(self._seq), self._clock(), request)
        heapq.heappush(self._heap, entry)
        self._fifo.append(entry)
        self._len += 1

    def remove(self, request: T) -> bool:
        """Forget a waiting request (its client left); False if it was not waiting.

        Its entry is only marked: :meth:`pop` skips it, as it skips those already served.
        """
        for entry in self._fifo:
            if entry.request is request and not entry.taken:
                entry.taken = True
                self._len -= 1
                return True
        return False

    def pop(self) -> T:
        """The next request to admit; IndexError when empty."""
        if not self._len:
            raise IndexError("pop from an empty prefill queue")
        while self._fifo[0].taken:
            self._fifo.popleft()
        oldest = self._fifo[0]
        if self._clock() - oldest.enqueued > self.starvation_window_s:
            entry = self._fifo.popleft()
            if len(self._heap) > 2 * self._len + 64:  # drop entries the FIFO already served
                self._heap = [e for e in self._heap if not e.taken and e is not entry]
                heapq.heapify(self._heap)
        else:
            while (entry := heapq.heappop(self._heap)).taken:
                pass
        entry.taken = True
        self._len -= 1
        return entry.request


@dataclass(eq=False)
class _Waiting(Generic[T]):
    request: T
    doc_ids: tuple[DocId, ...]
    prompt_tokens: int
    enqueued: float
    documents: frozenset[DocId]


class WindowScheduler(Generic[T]):
    """Choose the next request *and* its document order together, over a bounded window.

    RAGCache's queue ranks waiting requests by cached/compute tokens; it cannot see that two
    waiting requests share documents the cache does not hold yet. Here the next request is taken
    from the oldest ``window_requests`` waiting ones (and, with ``window_s``, only those that
    arrived within that many seconds of the oldest), ordered with :class:`ExactOrder` against the
    tree at the moment it is admitted, and chosen by cached/compute ratio with ties to the one
    sharing most documents with the rest of the window. Behind its cached prefix its documents
    are ordered for the window: first the document most of the waiting requests that share that
    prefix also hold, then the most common among those holding both, and so on (the offline
    plan's shared-prefix tree, built over what is waiting), so the requests admitted next find
    those documents cached. A request that has waited past ``starvation_window_s`` goes next,
    as in :class:`RatioQueue`.
    """

    def __init__(
        self,
        starvation_window_s: float,
        *,
        window_requests: int = 16,
        window_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if starvation_window_s < 0 or window_requests < 1 or (window_s is not None and window_s < 0):
            raise InvalidInputError("the windows must be positive and the starvation window not negative")
        self.starvation_window_s = starvation_window_s
        self.window_requests = window_requests
        self.window_s = window_s
        self._clock = clock
        self._policy = ExactOrder()
        self._waiting: list[_Waiting[T]] = []

    def __len__(self) -> int:
        return len(self._waiting)

    def push(self, request: T, doc_ids: Sequence[DocId], prompt_tokens: int) -> None:
        """Queue a request with its documents (retrieval rank) and its prompt length in tokens."""
        documents = frozenset(doc_ids)
        if len(documents) != len(doc_ids):
            raise InvalidInputError("a request lists the same document twice")
        if prompt_tokens < 0:
            raise InvalidInputError("the prompt length cannot be negative")
        self._waiting.append(_Waiting(request, tuple(doc_ids), prompt_tokens, self._clock(), documents))

    def remove(self, request: T) -> bool:
        """Forget a waiting request (its client left); False if it was not waiting."""
        for index, waiting in enumerate(self._waiting):
            if waiting.request is request:
                del self._waiting[index]
                return True
        return False

    def pop(self, tree: KnowledgeTree) -> tuple[T, Ordering]:
        """The request to admit now and its document order; IndexError when empty."""
        if not self._waiting:
            raise IndexError("pop from an empty window scheduler")
        oldest = self._waiting[0]
        if self._clock() - oldest.enqueued > self.starvation_window_s:
            window = [oldest]
        else:
            window = self._waiting[: self.window_requests]
            if self.window_s is not None:
                window = [w for w in window if w.enqueued - oldest.enqueued <= self.window_s]
        shared = Counter(d for w in window for d in w.documents)
        best: tuple[float, int, int] | None = None
        chosen = oldest
        chosen_order = None
        for index, waiting in enumerate(window):
            ordering = self._policy.order(tree, waiting.doc_ids)
            cached = ordering.cached.tokens
            ratio = cached / max(waiting.prompt_tokens - cached, 1)
            score = (ratio, sum(shared[d] for d in waiting.documents), -index)
            if best is None or score > best:
                best, chosen, chosen_order = score, waiting, ordering
        assert chosen_order is not None
        self._waiting.remove(chosen)
        others = [w.documents for w in window if w is not chosen]
        return chosen.request, _order_for_window(tree, chosen_order, others)


def _order_for_window(tree: KnowledgeTree, ordering: Ordering, others: list[frozenset[DocId]]) -> Ordering:
    """Reorder what follows the cached prefix for the waiting requests that share that prefix.

    The prefix is the leading whole documents the engine holds, plus the next one when its
    leading blocks survive (then keeping it in place is what reuses them).
    """
    cached = (ordering.cached.tokens, ordering.cached.docs)
    for keep in (ordering.cached.docs, ordering.cached.docs + 1):
        reordered = _shared_first(ordering.doc_ids, keep, others)
        match = tree.cached_prefix(reordered)
        if (match.tokens, match.docs) >= cached:
            return Ordering(reordered, match)
    return ordering


def _shared_first(ordered: tuple[DocId, ...], keep: int, others: list[frozenset[DocId]]) -> tuple[DocId, ...]:
    """Keep ``keep`` leading documents, then greedily the one most of the requests holding the
    path so far also hold (the offline plan's shared-prefix tree, over the waiting requests)."""
    head = ordered[:keep]
    group = [docs for docs in others if docs.issuperset(head)]
    rest = list(ordered[keep:])
    tail: list[DocId] = []
    while group and rest:
        counts = Counter(d for docs in group for d in docs)
        doc_id = max(rest, key=lambda d: counts[d])  # the first of equals: exact's order breaks ties
        if not counts[doc_id]:
            break
        tail.append(doc_id)
        rest.remove(doc_id)
        group = [docs for docs in group if doc_id in docs]
    return (*head, *tail, *rest)
