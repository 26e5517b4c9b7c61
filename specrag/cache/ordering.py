"""Document-ordering policies behind one interface, selectable by name.

All of them return a permutation of the request's documents. The cache-aware ones put the
longest prefix the engine already holds first; what follows it is ordered for *future* sharing:
popular documents first (retrieval rank breaks ties), so that requests drawing from the same
popular documents converge on the same path of the tree. The order hint (hints.py) tells the
model the original ranking whenever the order changed.

- ``retrieval``: the retriever's order (plain APC baseline).
- ``sorted``: by document id, a canonical order with no cache knowledge.
- ``recency``: most recently served documents first.
- ``greedy``: RAGCache++'s trie walk, first resident child in rank order at each level.
- ``exact`` / ``exact-rank``: the best resident prefix by depth-first search of the trie limited
  to the request's documents; "best" is most cached tokens (what APC saves), ties to more whole
  documents, then more hits; the rest by popularity (``exact``) or retrieval rank (``exact-rank``).
- ``oracle``: every order of the documents, scored by a probe (the tree by default, the real cache
  in benchmarks); exhaustive over k! orders, skipping only extensions of a broken prefix, which
  can never reuse more.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from specrag.cache.layout import DocId
from specrag.cache.tree import KnowledgeTree, Node, PrefixMatch
from specrag.errors import InvalidInputError

Probe = Callable[[Sequence[DocId]], PrefixMatch]


@dataclass(frozen=True, slots=True)
class Ordering:
    """Documents in prompt order and what the tree expects the engine to reuse of them."""

    doc_ids: tuple[DocId, ...]
    cached: PrefixMatch


class OrderingPolicy(Protocol):
    name: str

    def order(self, tree: KnowledgeTree, doc_ids: Sequence[DocId]) -> Ordering: ...


def _check_distinct(doc_ids: Sequence[DocId]) -> None:
    if len(set(doc_ids)) != len(doc_ids):
        raise InvalidInputError("a request lists the same document twice")


def _sort_key(doc_id: DocId) -> tuple[int, int, str]:
    """Ints before strings, each in natural order, so mixed ids sort without a TypeError."""
    return (0, doc_id, "") if isinstance(doc_id, int) else (1, 0, doc_id)


def _by_popularity(tree: KnowledgeTree, doc_ids: Sequence[DocId]) -> list[DocId]:
    """Most served first; ``sorted`` is stable, so retrieval rank breaks ties."""
    return sorted(doc_ids, key=lambda d: -tree.popularity(d))


class _Reorder:
    """Policies that only permute the ids: the cached prefix is measured afterwards."""

    name = ""

    def order(self, tree: KnowledgeTree, doc_ids: Sequence[DocId]) -> Ordering:
        _check_distinct(doc_ids)
        ordered = tuple(self._permute(tree, doc_ids))
        return Ordering(ordered, tree.cached_prefix(ordered))

    def _permute(self, tree: KnowledgeTree, doc_ids: Sequence[DocId]) -> Sequence[DocId]:
        raise NotImplementedError


class RetrievalOrder(_Reorder):
    name = "retrieval"

    def _permute(self, tree: KnowledgeTree, doc_ids: Sequence[DocId]) -> Sequence[DocId]:
        return doc_ids


class SortedOrder(_Reorder):
    name = "sorted"

    def _permute(self, tree: KnowledgeTree, doc_ids: Sequence[DocId]) -> Sequence[DocId]:
        return sorted(doc_ids, key=_sort_key)


class RecencyOrder(_Reorder):
    name = "recency"

    def _permute(self, tree: KnowledgeTree, doc_ids: Sequence[DocId]) -> Sequence[DocId]:
        return sorted(doc_ids, key=lambda d: -tree.last_used(d))


class GreedyOrder(_Reorder):
    """RAGCache++ Algorithm 1: no look-ahead, the rest in retrieval rank."""

    name = "greedy"

    def _permute(self, tree: KnowledgeTree, doc_ids: Sequence[DocId]) -> Sequence[DocId]:
        node = tree.root
        if node.missing:
            return doc_ids
        prefix: list[DocId] = []
        remaining = list(doc_ids)
        while remaining:
            for i, doc_id in enumerate(remaining):
                child = node.children.get(doc_id)
                if child is not None and child.missing == 0:
                    prefix.append(remaining.pop(i))
                    node = child
                    break
            else:
                break
        return prefix + remaining


class ExactOrder:
    """Best resident prefix over all orders of the request's documents, by a bounded DFS.

    The search visits only resident nodes whose path uses distinct candidates, so it costs
    O(k) per such node and never more than k levels. At every reached node it also looks one
    step further for a non-resident child whose leading blocks survive (vLLM evicts a prompt's
    tail first), because putting that document next still reuses those blocks.
    """

    def __init__(self, name: str = "exact", *, popular_tail: bool = True) -> None:
        self.name = name
        self._popular_tail = popular_tail

    def order(self, tree: KnowledgeTree, doc_ids: Sequence[DocId]) -> Ordering:
        _check_distinct(doc_ids)
        prefix: list[DocId] = []
        if not tree.root.missing:
            search = _PrefixSearch(tree, doc_ids)
            search.visit(tree.root)
            prefix = search.best_prefix
        chosen = set(prefix)
        rest = [d for d in doc_ids if d not in chosen]
        if self._popular_tail:
            rest = _by_popularity(tree, rest)
        ordered = (*prefix, *rest)
        return Ordering(ordered, tree.cached_prefix(ordered))


class _PrefixSearch:
    """Depth-first search state of :class:`ExactOrder`; score = (tokens, docs, hits)."""

    def __init__(self, tree: KnowledgeTree, doc_ids: Sequence[DocId]) -> None:
        self.tree = tree
        self.doc_ids = doc_ids
        self.candidates = set(doc_ids)
        self.best: tuple[int, int, int] = (-1, -1, -1)
        self.best_prefix: list[DocId] = []
        self._path: list[DocId] = []
        self._ends: list[int] = []

    def visit(self, node: Node) -> None:
        tree = self.tree
        frontier_tokens = tree.resident_tokens(node)
        frontier: DocId | None = None
        remaining = self.candidates
        if len(node.children) < len(remaining):
            pairs = [(d, c) for d, c in node.children.items() if d in remaining]
        else:
            pairs = [
                (d, c) for d in self.doc_ids if d in remaining and (c := node.children.get(d)) is not None
            ]
        for doc_id, child in pairs:
            if child.missing == 0:
                remaining.discard(doc_id)
                self._path.append(doc_id)
                self._ends.append(child.end)
                self.visit(child)
                self._ends.pop()
                self._path.pop()
                remaining.add(doc_id)
            elif (tokens := tree.partial_tokens(child)) > frontier_tokens:
                frontier_tokens, frontier = tokens, doc_id
        score = (frontier_tokens, bisect_right(self._ends, frontier_tokens), node.hits)
        if score > self.best:
            self.best = score
            self.best_prefix = self._path + ([frontier] if frontier is not None else [])


class OracleOrder:
    """Exhaustive search over all orders, scored by ``probe`` (default: the tree itself).

    A prefix whose last document is not fully cached is not extended: the engine's chained
    blocks stop there, so no extension reuses more documents or tokens. Exponential in the
    worst case; meant for tests and benchmarks, not for serving.
    """

    name = "oracle"

    def __init__(self, probe: Probe | None = None) -> None:
        self._probe = probe

    def order(self, tree: KnowledgeTree, doc_ids: Sequence[DocId]) -> Ordering:
        _check_distinct(doc_ids)
        probe = self._probe or tree.cached_prefix
        best: list[tuple[PrefixMatch, tuple[DocId, ...]]] = [(probe(()), ())]  # by (tokens, docs)

        def visit(prefix: tuple[DocId, ...], remaining: list[DocId]) -> None:
            for i, doc_id in enumerate(remaining):
                extended = (*prefix, doc_id)
                match = probe(extended)
                if (match.tokens, match.docs) > (best[0][0].tokens, best[0][0].docs):
                    best[0] = (match, extended)
                if match.unbroken:
                    visit(extended, remaining[:i] + remaining[i + 1 :])

        visit((), list(doc_ids))
        prefix = best[0][1]
        chosen = set(prefix)
        ordered = (*prefix, *_by_popularity(tree, [d for d in doc_ids if d not in chosen]))
        return Ordering(ordered, probe(ordered))


_FACTORIES: dict[str, Callable[[], OrderingPolicy]] = {
    "retrieval": RetrievalOrder,
    "sorted": SortedOrder,
    "recency": RecencyOrder,
    "greedy": GreedyOrder,
    "exact": ExactOrder,
    "exact-rank": lambda: ExactOrder("exact-rank", popular_tail=False),
    "oracle": OracleOrder,
}
POLICY_NAMES: tuple[str, ...] = tuple(_FACTORIES)


def get_policy(name: str) -> OrderingPolicy:
    """A fresh policy by name; unknown names raise InvalidInputError listing the known ones."""
    try:
        return _FACTORIES[name]()
    except KeyError:
        raise InvalidInputError(
            f"unknown ordering policy {name!r}; known: {', '.join(POLICY_NAMES)}"
        ) from None
