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
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy.cluster.hierarchy import linkage
from scipy.sparse import bmat, csr_matrix
from scipy.sparse.csgraph import connected_components

from specrag.cache.layout import DocId
from specrag.errors import InvalidInputError


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """Execution order (request indices), each request's document order, and its search path."""

    order: tuple[int, ...]
    contexts: tuple[tuple[DocId, ...], ...]
    paths: tuple[tuple[int, ...], ...]


@dataclass(eq=False)
class _Cluster:
    content: frozenset[DocId]
    children: list[_Cluster] = field(default_factory=list)
    unique_id: int | None = None  # leaves only: index of a distinct context
    size: int = 0  # requests below


def context_distances(x: csr_matrix, positions: csr_matrix, alpha: float) -> np.ndarray:
    """Condensed distances: 1 - shared / max(len) + alpha * rms position shift of shared docs.

    Only pairs sharing a document are computed (the rest stay at distance 1). Positions count
    from 1, so every product below is non-zero exactly where two contexts share a document:
    the four sparse results have one pattern and their data arrays line up once sorted.
    """
    m = x.shape[0]
    squares = positions.multiply(positions).tocsr()
    products = [x @ x.T, squares @ x.T, x @ squares.T, positions @ positions.T]
    pattern = products[0]
    if not all(np.array_equal(p.indices, pattern.indices) for p in products[1:]):
        for product in products:  # same-structure operands give one order; sort only if not
            product.sort_indices()
    shared, squares_i, squares_j, cross = (p.data for p in products)
    indptr, cols = pattern.indptr, pattern.indices
    rows = np.repeat(np.arange(m), np.diff(indptr))
    upper = rows < cols
    rows, cols, count = rows[upper], cols[upper], shared[upper]
    squared_shift = np.maximum(squares_i[upper] + squares_j[upper] - 2.0 * cross[upper], 0.0)
    lengths = np.diff(x.indptr)
    values = 1.0 - count / np.maximum(lengths[rows], lengths[cols]) + alpha * np.sqrt(squared_shift / count)
    condensed = np.ones(m * (m - 1) // 2)
    condensed[m * rows - rows * (rows + 1) // 2 + cols - rows - 1] = values
    return condensed


def plan_batch(
    contexts: Sequence[Sequence[DocId]], *, alpha: float = 0.005, method: str = "average"
) -> BatchPlan:
    """Cluster, order and schedule ``contexts`` (each a list of doc ids in retrieval rank)."""
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

    leaves = [_Cluster(frozenset(ctx), unique_id=u, size=len(groups[u])) for u, ctx in enumerate(unique)]
    root = _Cluster(frozenset())
    root.children = [_cluster_component(leaves, comp, unique, alpha, method) for comp in _components(unique)]
    _splice(root)

    reordered: list[tuple[DocId, ...]] = [tuple(ctx) for ctx in contexts]
    paths: list[tuple[int, ...]] = [() for _ in contexts]
    order: list[int] = []
    stack: list[tuple[_Cluster, tuple[DocId, ...], tuple[int, ...]]] = [(root, (), ())]
    while stack:
        node, prefix, path = stack.pop()
        if node.unique_id is not None:
            in_prefix = set(prefix)
            docs = (*prefix, *(d for d in unique[node.unique_id] if d not in in_prefix))
            for request in groups[node.unique_id]:
                reordered[request], paths[request] = docs, path
                order.append(request)
            continue
        node.children.sort(key=lambda c: -c.size)
        for index in reversed(range(len(node.children))):
            child = node.children[index]
            if child.unique_id is None:  # shared documents: most frequent in the batch first
                new = sorted(child.content - node.content, key=lambda d: (-frequency[d], first_seen[d]))
                stack.append((child, (*prefix, *new), (*path, index)))
            else:
                stack.append((child, prefix, (*path, index)))
    return BatchPlan(tuple(order), tuple(reordered), tuple(paths))


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
