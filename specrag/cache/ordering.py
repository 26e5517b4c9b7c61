"""Document-ordering policies behind one interface, selectable by name.

All of them return a permutation of the request's documents. The cache-aware ones put the
longest prefix the engine already holds first; what follows it is ordered for *future* sharing:
the path earlier requests took (even where a small cache evicted it), then the documents most
often served together with this request's (retrieval rank breaks ties), so that requests on one
subject converge on one path of the tree. The order hint (hints.py) tells the model the original
ranking whenever the order changed.

- ``retrieval``: the retriever's order (plain APC baseline).
- ``sorted``: by document id, a canonical order with no cache knowledge.
- ``recency``: most recently served documents first.
- ``greedy``: RAGCache++'s trie walk, first resident child in rank order at each level.
- ``exact`` / ``exact-rank``: the best resident prefix by depth-first search of the trie limited
  to the request's documents; "best" is most cached tokens (what APC saves), ties to more whole
  documents, then more hits; the rest along the most travelled remembered path, then by affinity
  (``exact``), or in retrieval rank (``exact-rank``).

``bench.ordering.oracle`` adds the benchmarks' myopic oracle (every order, scored by a probe).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import NamedTuple, Protocol

from specrag.cache.layout import DocId
from specrag.cache.tree import KnowledgeTree, Node, PrefixMatch
from specrag.errors import InvalidInputError, check_choice

__all__ = [
    "POLICY_NAMES",
    "ExactOrder",
    "GreedyOrder",
    "Ordering",
    "OrderingPolicy",
    "PolicyName",
    "Probe",
    "RecencyOrder",
    "RetrievalOrder",
    "SortedOrder",
    "by_affinity",
    "check_distinct",
    "get_policy",
]

Probe = Callable[[Sequence[DocId]], PrefixMatch]


@dataclass(frozen=True, slots=True)
class Ordering:
    """Documents in prompt order and what the tree expects the engine to reuse of them."""

    doc_ids: tuple[DocId, ...]
    cached: PrefixMatch


class OrderingPolicy(Protocol):
    name: str

    def order(self, tree: KnowledgeTree, doc_ids: Sequence[DocId]) -> Ordering: ...


def check_distinct(doc_ids: Sequence[DocId]) -> None:
    if len(set(doc_ids)) != len(doc_ids):
        raise InvalidInputError("a request lists the same document twice")


def _sort_key(doc_id: DocId) -> tuple[int, int, str]:
    """Ints before strings, each in natural order, so mixed ids sort without a TypeError."""
    return (0, doc_id, "") if isinstance(doc_id, int) else (1, 0, doc_id)


class _Reorder:
    """Policies that only permute the ids: the cached prefix is measured afterwards."""

    name = ""

    def order(self, tree: KnowledgeTree, doc_ids: Sequence[DocId]) -> Ordering:
        check_distinct(doc_ids)
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

    After that prefix the prompt follows the most travelled path the tree remembers below it,
    resident or not: a path evicted from a small cache is where earlier requests went, so taking
    it again re-creates blocks that later requests (which follow the same path) reuse, instead of
    forking a new branch that only this request uses. What is left is ordered by *affinity*:
    how often each document was served together with this request's documents (its own
    popularity included), so the documents later requests of the same subject are likely to
    share come first, and an off-topic document, however popular elsewhere, comes last. With
    ``rank_tail`` the rest keeps retrieval rank instead (``exact-rank``).
    """

    def __init__(self, name: str = "exact", *, rank_tail: bool = False) -> None:
        self.name = name
        self._rank_tail = rank_tail

    def order(self, tree: KnowledgeTree, doc_ids: Sequence[DocId]) -> Ordering:
        candidates = set(doc_ids)
        if len(candidates) != len(doc_ids):
            raise InvalidInputError("a request lists the same document twice")
        if tree.root.missing:  # not even the system prompt is cached: no prefix to find
            found, prefix = None, []
        else:
            found = _best_resident_prefix(tree, doc_ids, candidates)
            prefix = [*found.path]
            candidates.difference_update(prefix)
            _follow_travelled_path(found.node, candidates, prefix)
        rest = [d for d in doc_ids if d in candidates]
        if len(rest) > 1 and not self._rank_tail:
            rest = by_affinity(tree, doc_ids, rest)
        ordered = (*prefix, *rest)
        if found is None:
            return Ordering(ordered, tree.cached_prefix(ordered))
        return Ordering(ordered, _cached_after_search(tree, found, ordered))


def _cached_after_search(tree: KnowledgeTree, found: _Prefix, ordered: tuple[DocId, ...]) -> PrefixMatch:
    """``tree.cached_prefix(ordered)`` without walking again the prefix the search measured.

    Past a frontier the engine reuses nothing, and below the prefix's last node the next
    document is most often absent or evicted; only where it is resident, or leaves more than the
    prefix reuses, does the walk run.
    """
    reused = len(found.path)
    if found.frontier or reused == len(ordered):
        return PrefixMatch(found.docs, found.tokens, not found.frontier)
    child = found.node.children.get(ordered[reused])
    if child is None or (child.missing and tree.partial_tokens(child) == found.tokens):
        return PrefixMatch(found.docs, found.tokens)
    return tree.cached_prefix(ordered)


def _follow_travelled_path(node: Node, candidates: set[DocId], path: list[DocId]) -> None:
    """Extend ``path`` from ``node`` through the most used children among ``candidates``."""
    while candidates and node.children:
        children = node.children
        best: Node | None = None
        for doc_id in candidates:
            child = children.get(doc_id)
            if child is not None and (best is None or child.pgdsf.frequency > best.pgdsf.frequency):
                best = child
        if best is None:
            return
        assert best.doc_id is not None  # only the root has none
        path.append(best.doc_id)
        candidates.discard(best.doc_id)
        node = best


def by_affinity(tree: KnowledgeTree, request: Sequence[DocId], rest: list[DocId]) -> list[DocId]:
    """``rest`` by how often each was served with the request's documents (itself included:
    its popularity), most first; retrieval rank breaks ties (the sort is stable). ``map`` keeps
    the k² look-ups in C.
    """
    rows = tree.companion_rows(rest)
    if not any(rows):
        return rest  # nothing of it was ever served: retrieval rank
    zeros = repeat(0)
    scores = [-sum(map(row.get, request, zeros)) if row else 0 for row in rows]
    ranked = sorted(range(len(rest)), key=scores.__getitem__)
    return [rest[i] for i in ranked]


class _Prefix(NamedTuple):
    """The search's best prefix: its documents, last node, reused tokens and whole documents;
    ``frontier``: it ends with a non-resident document whose leading blocks are reused."""

    path: list[DocId]
    node: Node
    tokens: int
    docs: int
    frontier: bool


def _best_resident_prefix(tree: KnowledgeTree, doc_ids: Sequence[DocId], candidates: set[DocId]) -> _Prefix:
    """Depth-first search of resident paths made of ``candidates``; best = (tokens, docs, hits).

    The path may end with a non-resident document whose leading blocks survive (the frontier).
    No path of the tree holds a document twice (the tree rejects such prompts), so a child is
    never on the path above it: the search keeps no set of documents left, no path and no list
    of document ends, only the depth, and the best path is read off its last node's parents at
    the end. A closure over locals, not an object, and the best score kept as three scalars: this
    runs on every request's critical path, where local look-ups and no per-node allocation are
    what Python makes cheap.
    """
    block = tree.block_size
    partial_tokens = tree.partial_tokens
    k = len(candidates)
    best_tokens = best_docs = best_hits = -1
    best_node = tree.root
    best_frontier = False

    def visit(node: Node, depth: int) -> None:
        nonlocal best_tokens, best_docs, best_hits, best_node, best_frontier
        tokens = node.end // block * block
        frontier: Node | None = None
        children = node.children
        if children:
            if len(children) < k - depth:  # the smaller side (its order is the one ties follow)
                below: Iterable[tuple[DocId, Node | None]] = children.items()
            else:
                below = zip(doc_ids, map(children.get, doc_ids), strict=True)
            for doc_id, child in below:
                if child is None or doc_id not in candidates:
                    continue
                if missing := child.missing:
                    # at most its stored blocks lead: skip the count when even they cannot win
                    # (in a small cache most evicted children have none left)
                    stored_at_most = child.first_block + len(child.keys) - missing
                    if stored_at_most * block > tokens and (partial := partial_tokens(child)) > tokens:
                        tokens, frontier = partial, child
                    continue
                if child.children or child.end // block * block >= best_tokens:  # else a leaf that
                    visit(child, depth + 1)  # reuses less than the best: it cannot win, skip the call
        if tokens < best_tokens:
            return
        docs = depth  # the documents on the path lying whole inside the reused tokens
        last = node
        while docs and last.end > tokens:  # only a document ending mid-block can stick out
            docs -= 1
            last = last.parent  # type: ignore[assignment]  # a node at depth > 0 has one
        if tokens == best_tokens:
            if docs < best_docs:
                return
            if docs == best_docs:
                hits = node.pgdsf.frequency  # hits only break ties: read them last
                if hits <= best_hits:
                    return
                best_hits = hits
            else:
                best_docs, best_hits = docs, node.pgdsf.frequency
        else:
            best_tokens, best_docs, best_hits = tokens, docs, node.pgdsf.frequency
        if frontier is None:
            best_node, best_frontier = node, False
        else:
            best_node, best_frontier = frontier, True

    visit(tree.root, 0)
    path: list[DocId] = []
    node: Node | None = best_node
    while node is not None and node.doc_id is not None:
        path.append(node.doc_id)
        node = node.parent
    path.reverse()
    return _Prefix(path, best_node, best_tokens, best_docs, best_frontier)


class PolicyName(enum.StrEnum):
    """The ordering policies by name (see each policy's class)."""

    RETRIEVAL = "retrieval"
    SORTED = "sorted"
    RECENCY = "recency"
    GREEDY = "greedy"
    EXACT = "exact"
    EXACT_RANK = "exact-rank"


POLICY_NAMES: tuple[PolicyName, ...] = tuple(PolicyName)
_FACTORIES: dict[PolicyName, Callable[[], OrderingPolicy]] = {
    PolicyName.RETRIEVAL: RetrievalOrder,
    PolicyName.SORTED: SortedOrder,
    PolicyName.RECENCY: RecencyOrder,
    PolicyName.GREEDY: GreedyOrder,
    PolicyName.EXACT: ExactOrder,
    PolicyName.EXACT_RANK: lambda: ExactOrder(PolicyName.EXACT_RANK, rank_tail=True),
}


def get_policy(name: str) -> OrderingPolicy:
    """A fresh policy by name; unknown names raise InvalidInputError listing the known ones."""
    return _FACTORIES[check_choice("ordering policy", name, PolicyName)]()
