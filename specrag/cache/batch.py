"""Batch mode: order and schedule a known set of requests for the most prefix sharing.

Following ContextPilot (Algorithms 4 and 5): cluster the contexts hierarchically by a distance
that counts shared documents and penalises their misalignment, turn the dendrogram into a
canonical shared-prefix tree (a cluster's documents are the intersection of its members'; a
cluster adding no document to its parent is spliced out), order every context along its path
(the shared documents of each ancestor first, its own documents last in retrieval rank), and
run requests in depth-first order of that tree, larger subtrees first. Depth-first keeps
siblings adjacent at every level, which is what an LRU cache needs; Algorithm 5's grouping by
the first path element, largest group first, is its top level.

The distance (ContextPilot eq. 1, its positional term as root-mean-square displacement so that
every term is a sparse matrix product) is computed per connected component of the
"shares a document" graph: contexts in different components share nothing and would only join
at the root. No pairwise Python loop; scipy does the products and the linkage.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy.cluster.hierarchy import linkage
from scipy.sparse import bmat, csr_matrix, hstack
from scipy.sparse.csgraph import connected_components

from specrag.cache.layout import DocId
from specrag.errors import InvalidInputError

__all__ = ["BatchPlan", "context_distances", "plan_batch"]

_SHIFT_SCALE = float(2**32)
_DENSE_BLOCK_ROWS = 256  # rows of x xᵀ made dense at once: 256 x 4,000 requests is 8 MB


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """Execution order (request indices) and each request's document order."""

    order: tuple[int, ...]
    contexts: tuple[tuple[DocId, ...], ...]


@dataclass(eq=False)
class _Cluster:
    content: frozenset[DocId]
    children: list[_Cluster] = field(default_factory=list)
    unique_id: int | None = None  # leaves only: index of a distinct context
    size: int = 0  # requests below


def context_distances(x: csr_matrix, positions: csr_matrix, alpha: float) -> np.ndarray:
    """Condensed distances: 1 - shared / max(len) + alpha * rms position shift of shared docs.

    Only pairs sharing a document are computed (the rest stay at distance 1), all in one sparse
    product: with positions counted from 1, the left factor ``[S x + p², x, -2 p]`` times the
    right factor ``[x, p², p]`` gives ``S * shared + sum((p_i - p_j)²)`` over shared documents,
    every term an integer, so with ``S = 2**32`` (more than any squared shift of a context
    shorter than 1,600 documents) both parts come back exactly. Without the positional term
    (``alpha == 0``) the product is ``x xᵀ`` alone.
    """
    m = x.shape[0]
    if alpha:
        squares = positions.multiply(positions).tocsr()
        left = hstack([x * _SHIFT_SCALE + squares, x, positions * -2.0], format="csr")
        right = hstack([x, squares, positions], format="csr")
        product = (left @ right.T).tocsr()
    else:
        product = (x @ x.T).tocsr()
        if product.nnz > m * m // 4:  # most pairs share a document: row blocks beat the pair lists
            return _dense_shared_distances(product, np.diff(x.indptr))
    indptr, cols, data = product.indptr, product.indices, product.data
    rows = np.repeat(np.arange(m), np.diff(indptr))
    upper = rows < cols
    rows, cols, data = rows[upper], cols[upper], data[upper]
    lengths = np.diff(x.indptr)
    if alpha:
        shared = np.floor(data / _SHIFT_SCALE)
        shift = alpha * np.sqrt(np.maximum(data - shared * _SHIFT_SCALE, 0.0) / shared)
    else:
        shared, shift = data, 0.0
    values = 1.0 - shared / np.maximum(lengths[rows], lengths[cols]) + shift
    condensed = np.ones(m * (m - 1) // 2)
    condensed[m * rows - rows * (rows + 1) // 2 + cols - rows - 1] = values
    return condensed


def _dense_shared_distances(shared: csr_matrix, lengths: np.ndarray) -> np.ndarray:
    """:func:`context_distances` without the positional term, from ``x xᵀ`` read in dense row
    blocks: where most pairs share a document (one popular document is enough), listing every
    pair's row, column and condensed index costs several times the arithmetic. Row ``i``'s pairs
    ``(i, j > i)`` are one contiguous run of the condensed vector.
    """
    m = shared.shape[0]
    condensed = np.empty(m * (m - 1) // 2)
    lengths = np.maximum(lengths, 1)  # an empty context shares nothing: 0 / 1 keeps its 1.0
    start = 0
    for first in range(0, m, _DENSE_BLOCK_ROWS):
        last = min(first + _DENSE_BLOCK_ROWS, m)
        values = 1.0 - shared[first:last].toarray() / np.maximum(lengths[first:last, None], lengths[None, :])
        for i in range(first, last):
            condensed[start : start + m - i - 1] = values[i - first, i + 1 :]
            start += m - i - 1
    return condensed


def plan_batch(
    contexts: Sequence[Sequence[DocId]],
    *,
    alpha: float = 0.0,
    method: str = "average",
    refine_passes: int = 1,
) -> BatchPlan:
    """Cluster, order and schedule ``contexts`` (each a list of doc ids in retrieval rank).

    ``alpha`` weighs ContextPilot's positional term (0 by default: on every trace of
    ``bench.ordering`` it changed reuse by less than 0.005 and it triples the distance cost).
    ``refine_passes`` bounds the re-insertion passes over the plan's prefix tree.
    """
    if alpha < 0 or refine_passes < 0:
        raise InvalidInputError("alpha and refine_passes cannot be negative")
    for i, ctx in enumerate(contexts):
        if len(set(ctx)) != len(ctx):
            raise InvalidInputError(f"request {i} lists the same document twice")
    members: dict[frozenset[DocId], list[int]] = {}
    for i, ctx in enumerate(contexts):
        members.setdefault(frozenset(ctx), []).append(i)
    unique = [contexts[group[0]] for group in members.values()]
    groups = list(members.values())
    frequency = Counter(d for ctx in contexts for d in ctx)
    first_seen = {d: i for i, d in enumerate(frequency)}  # Counter keeps first-seen order

    def by_frequency(docs: Iterable[DocId]) -> list[DocId]:
        return sorted(docs, key=lambda d: (-frequency[d], first_seen[d]))

    leaves = [_Cluster(frozenset(ctx), unique_id=u, size=len(groups[u])) for u, ctx in enumerate(unique)]
    root = _Cluster(frozenset())
    root.children = [_cluster_component(leaves, comp, unique, alpha, method) for comp in _components(unique)]
    _splice(root)

    orders: list[tuple[DocId, ...]] = [()] * len(unique)
    stack: list[tuple[_Cluster, tuple[DocId, ...]]] = [(root, ())]
    while stack:
        node, prefix = stack.pop()
        if node.unique_id is not None:
            in_prefix = set(prefix)
            orders[node.unique_id] = (*prefix, *by_frequency(d for d in node.content if d not in in_prefix))
            continue
        for child in node.children:  # shared documents: most frequent in the batch first
            stack.append(
                (
                    child,
                    prefix
                    if child.unique_id is not None
                    else (*prefix, *by_frequency(child.content - node.content)),
                )
            )

    trie = _PrefixTrie()
    for u, order in enumerate(orders):
        trie.add(order, len(groups[u]))
    for _ in range(refine_passes):
        changed = False
        for u, order in enumerate(orders):
            weight = len(groups[u])
            trie.add(order, -weight)
            path = trie.deepest_path(order)
            in_path = set(path)
            better = (*path, *by_frequency(d for d in order if d not in in_path))
            trie.add(better, weight)
            changed = changed or better != order
            orders[u] = better
        if not changed:
            break

    reordered: list[tuple[DocId, ...]] = [()] * len(contexts)
    for u, group in enumerate(groups):
        for request in group:
            reordered[request] = orders[u]
    by_order = {order: u for u, order in enumerate(orders)}
    schedule = [request for order in trie.depth_first(by_order) for request in groups[by_order[order]]]
    return BatchPlan(tuple(schedule), tuple(reordered))


class _TrieNode:
    __slots__ = ("children", "weight")

    def __init__(self) -> None:
        self.children: dict[DocId, _TrieNode] = {}
        self.weight = 0  # requests whose order passes through this node


class _PrefixTrie:
    """The plan's shared-prefix tree: document orders weighted by how many requests use them."""

    def __init__(self) -> None:
        self.root = _TrieNode()

    def add(self, order: Sequence[DocId], weight: int) -> None:
        """Add (or, with a negative weight, remove) requests using ``order``."""
        node = self.root
        for doc_id in order:
            child = node.children.get(doc_id)
            if child is None:
                child = node.children[doc_id] = _TrieNode()
            child.weight += weight
            if not child.weight:
                del node.children[doc_id]
                return
            node = child

    def deepest_path(self, docs: Sequence[DocId]) -> list[DocId]:
        """The longest path made only of ``docs``, ties to the most used; exhaustive, k levels."""
        best: list[DocId] = []
        best_weight = -1
        path: list[DocId] = []
        remaining = set(docs)

        def visit(node: _TrieNode) -> None:
            nonlocal best, best_weight
            if len(path) > len(best) or (len(path) == len(best) and node.weight > best_weight):
                best, best_weight = list(path), node.weight
            if len(path) + len(remaining) < len(best):
                return  # even every remaining document could not make a longer path
            children = node.children
            if len(children) < len(remaining):
                below = [(d, c) for d, c in children.items() if d in remaining]
            else:
                below = [(d, c) for d in remaining if (c := children.get(d)) is not None]
            for doc_id, child in below:
                remaining.discard(doc_id)
                path.append(doc_id)
                visit(child)
                path.pop()
                remaining.add(doc_id)

        visit(self.root)
        return best

    def depth_first(self, ends: dict[tuple[DocId, ...], int]) -> list[tuple[DocId, ...]]:
        """The orders in ``ends`` in depth-first order, heavier subtrees first, a path before its
        extensions: what runs consecutively shares the longest prefixes, as an LRU cache needs."""
        out: list[tuple[DocId, ...]] = []
        stack: list[tuple[_TrieNode, tuple[DocId, ...]]] = [(self.root, ())]
        while stack:
            node, path = stack.pop()
            if path in ends:
                out.append(path)
            children = sorted(node.children.items(), key=lambda item: item[1].weight)
            stack.extend((child, (*path, doc_id)) for doc_id, child in children)
        return out


def _components(unique: Sequence[Sequence[DocId]]) -> list[list[int]]:
    """Groups of contexts connected by shared documents (bipartite context-document graph)."""
    vocab: dict[DocId, int] = {}
    rows = [u for u, ctx in enumerate(unique) for _ in ctx]
    cols = [vocab.setdefault(d, len(vocab)) for ctx in unique for d in ctx]
    x = csr_matrix((np.ones(len(rows)), (rows, cols)), shape=(len(unique), len(vocab)))
    graph = bmat([[None, x], [x.T, None]], format="csr")
    _, labels = connected_components(graph, directed=False)
    by_label: dict[int, list[int]] = {}
    for u, label in enumerate(labels[: len(unique)]):
        by_label.setdefault(int(label), []).append(u)
    return list(by_label.values())


def _cluster_component(
    leaves: list[_Cluster], comp: list[int], unique: Sequence[Sequence[DocId]], alpha: float, method: str
) -> _Cluster:
    """The dendrogram of one component, internal nodes holding their members' intersection."""
    if len(comp) == 1:
        return leaves[comp[0]]
    vocab: dict[DocId, int] = {}
    rows, cols, pos = [], [], []
    for r, u in enumerate(comp):
        for p, d in enumerate(unique[u]):
            rows.append(r)
            cols.append(vocab.setdefault(d, len(vocab)))
            pos.append(p + 1.0)
    shape = (len(comp), len(vocab))
    x = csr_matrix((np.ones(len(rows)), (rows, cols)), shape=shape)
    positions = csr_matrix((pos, (rows, cols)), shape=shape)
    merges = linkage(context_distances(x, positions, alpha), method=method)
    nodes = [leaves[u] for u in comp]
    for a, b in merges[:, :2].astype(np.int64):
        left, right = nodes[a], nodes[b]
        nodes.append(_Cluster(left.content & right.content, [left, right], size=left.size + right.size))
    return nodes[-1]


def _splice(root: _Cluster) -> None:
    """Lift the children of internal clusters that add no document to their parent."""
    stack = [root]
    while stack:
        node = stack.pop()
        children: list[_Cluster] = []
        pending = list(node.children)
        while pending:
            child = pending.pop()
            if child.unique_id is None and child.content == node.content:
                pending.extend(child.children)
            else:
                children.append(child)
        children.reverse()
        node.children = children
        stack.extend(c for c in children if c.unique_id is None)
