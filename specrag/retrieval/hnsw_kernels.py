"""Numba kernels of a resumable HNSW search over faiss's graph arrays.

faiss cannot pause an HNSW search, so this re-implements faiss's bounded-queue search (greedy
descent through the upper levels, then the level-0 beam of ``search_from_candidates``) with all
of its state in arrays, so that :func:`expand` can stop after a number of node expansions and be
called again to continue. To return the same neighbours as faiss, the candidate queue and the
result heap reproduce faiss's heap operations and tie rules (value, then id) step for step.
Distances are "smaller is better": squared L2, or the negated inner product.

State layout: ``state = [queue size, valid entries in queue, expansions so far, finished]``.
"""

from __future__ import annotations

import numpy as np
from numba import njit

QUEUE_SIZE, QUEUE_VALID, EXPANSIONS, FINISHED = 0, 1, 2, 3
STATE_FIELDS = 4


@njit(cache=True, inline="always")
def _after(a_val, b_val, a_id, b_id):  # type: ignore[no-untyped-def]
    """faiss ``CMax::cmp2``: does (a_val, a_id) rank after (b_val, b_id) in a max-heap."""
    return a_val > b_val or (a_val == b_val and a_id > b_id)


@njit(cache=True)
def _sift_down(size, vals, ids, val, ident):  # type: ignore[no-untyped-def]
    """Place (val, ident) from the root down in the 1-based max-heap of ``size`` entries."""
    i = 1
    while True:
        i1 = i << 1
        i2 = i1 + 1
        if i1 > size:
            break
        if i2 == size + 1 or _after(vals[i1 - 1], vals[i2 - 1], ids[i1 - 1], ids[i2 - 1]):
            if _after(val, vals[i1 - 1], ident, ids[i1 - 1]):
                break
            vals[i - 1] = vals[i1 - 1]
            ids[i - 1] = ids[i1 - 1]
            i = i1
        else:
            if _after(val, vals[i2 - 1], ident, ids[i2 - 1]):
                break
            vals[i - 1] = vals[i2 - 1]
            ids[i - 1] = ids[i2 - 1]
            i = i2
    return i


@njit(cache=True)
def _heap_pop(size, vals, ids):  # type: ignore[no-untyped-def]
    i = _sift_down(size, vals, ids, vals[size - 1], ids[size - 1])
    vals[i - 1] = vals[size - 1]
    ids[i - 1] = ids[size - 1]


@njit(cache=True)
def _heap_push(size, vals, ids, val, ident):  # type: ignore[no-untyped-def]
    i = size
    while i > 1:
        father = i >> 1
        if not _after(val, vals[father - 1], ident, ids[father - 1]):
            break
        vals[i - 1] = vals[father - 1]
        ids[i - 1] = ids[father - 1]
        i = father
    vals[i - 1] = val
    ids[i - 1] = ident


@njit(cache=True)
def _heap_replace_top(size, vals, ids, val, ident):  # type: ignore[no-untyped-def]
    i = _sift_down(size, vals, ids, val, ident)
    vals[i - 1] = val
    ids[i - 1] = ident


# fastmath lets LLVM vectorise the reduction, as faiss's SIMD kernels do (sums differ in the last bits).
@njit(cache=True, fastmath=True)
def _distance(query, vectors, row, inner_product):  # type: ignore[no-untyped-def]
    acc = np.float32(0.0)
    if inner_product:
        for j in range(query.shape[0]):
            acc += query[j] * vectors[row, j]
        return -acc
    for j in range(query.shape[0]):
        diff = query[j] - vectors[row, j]
        acc += diff * diff
    return acc


@njit(cache=True)
def _queue_push(state, queue_dis, queue_ids, ident, val):  # type: ignore[no-untyped-def]
    """faiss ``MinimaxHeap::push``: a bounded max-heap that drops its worst entry when full."""
    size = state[QUEUE_SIZE]
    if size == queue_dis.shape[0]:
        if val >= queue_dis[0]:
            return
        if queue_ids[0] != -1:
            state[QUEUE_VALID] -= 1
        _heap_pop(size, queue_dis, queue_ids)
        size -= 1
    size += 1
    _heap_push(size, queue_dis, queue_ids, val, ident)
    state[QUEUE_SIZE] = size
    state[QUEUE_VALID] += 1


@njit(cache=True)
def _offer_result(result_dis, result_ids, val, ident):  # type: ignore[no-untyped-def]
    if result_dis[0] > val:
        _heap_replace_top(result_dis.shape[0], result_dis, result_ids, val, ident)


@njit(cache=True, nogil=True)
def enter(  # type: ignore[no-untyped-def]
    query,
    vectors,
    neighbors,
    offsets,
    cum_neighbors,
    entry_point,
    max_level,
    inner_product,
    visited,
    queue_dis,
    queue_ids,
    result_dis,
    result_ids,
    state,
):
    """Greedy descent to level 1, then seed the level-0 queue and results with the nearest node."""
    nearest = entry_point
    d_nearest = _distance(query, vectors, nearest, inner_product)
    for level in range(max_level, 0, -1):
        while True:
            previous = nearest
            base = offsets[nearest]
            for j in range(base + cum_neighbors[level], base + cum_neighbors[level + 1]):
                other = neighbors[j]
                if other < 0:
                    break
                d = _distance(query, vectors, other, inner_product)
                if d_nearest > d:
                    nearest = other
                    d_nearest = d
            if nearest == previous:
                break
    _queue_push(state, queue_dis, queue_ids, nearest, d_nearest)
    _offer_result(result_dis, result_ids, d_nearest, nearest)
    visited[nearest] = 1


@njit(cache=True, nogil=True)
def expand(  # type: ignore[no-untyped-def]
    query,
    vectors,
    neighbors,
    offsets,
    cum_neighbors,
    ef_search,
    inner_product,
    visited,
    queue_dis,
    queue_ids,
    result_dis,
    result_ids,
    state,
    budget,
):
    """Expand at most ``budget`` level-0 nodes; return True once the search has finished."""
    expanded = 0
    while state[QUEUE_VALID] > 0 and expanded < budget:
        # faiss MinimaxHeap::pop_min: the smallest valid entry, the highest slot on ties.
        size = state[QUEUE_SIZE]
        best = -1
        best_dis = np.float32(0.0)
        for i in range(size - 1, -1, -1):
            if queue_ids[i] != -1 and (best == -1 or queue_dis[i] < best_dis):
                best = i
                best_dis = queue_dis[i]
        node = queue_ids[best]
        queue_ids[best] = -1
        state[QUEUE_VALID] -= 1
        below = 0
        for i in range(size):
            if queue_dis[i] < best_dis:
                below += 1
        if below >= ef_search:
            state[FINISHED] = 1
            return True
        for j in range(offsets[node] + cum_neighbors[0], offsets[node] + cum_neighbors[1]):
            other = neighbors[j]
            if other < 0:
                break
            if visited[other]:
                continue
            visited[other] = 1
            d = _distance(query, vectors, other, inner_product)
            _offer_result(result_dis, result_ids, d, other)
            _queue_push(state, queue_dis, queue_ids, other, d)
        expanded += 1
        state[EXPANSIONS] += 1
    if state[QUEUE_VALID] == 0:
        state[FINISHED] = 1
    return state[FINISHED] == 1
