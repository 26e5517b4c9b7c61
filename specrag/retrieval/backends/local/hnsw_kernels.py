"""Numba kernels of a resumable HNSW search over faiss's graph arrays.

faiss cannot pause an HNSW search, so this re-implements faiss's bounded-queue search (greedy
descent through the upper levels, then the level-0 beam of ``search_from_candidates``) with all
of its state in arrays, so that :func:`expand` can stop after a number of node expansions and be
called again to continue. To return the same neighbours as faiss, the candidate queue and the
result heap reproduce faiss's heap operations and tie rules (value, then id) step for step.
Distances are "smaller is better": squared L2, or the negated inner product.

A search may be limited to some nodes (``allowed``, a bitmap as faiss's ``IDSelectorBitmap`` reads
it, used when ``filtered``): as faiss does with a selector, it still walks through every node but
offers only the allowed ones to its results, so hidden nodes lead to their neighbours.

State layout: ``state = [queue size, valid entries in queue, expansions so far, finished]``.
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["STATE_FIELDS", "enter", "expand", "sorted_results"]

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


@njit(cache=True, fastmath=True)
def _distances(query, vectors, rows, count, out, inner_product):  # type: ignore[no-untyped-def]
    """``_distance`` of the first ``count`` of ``rows`` into ``out``, four rows at a time.

    Four independent sums per pass over the query (faiss's ``distances_batch_4``) keep four
    vector loads in flight instead of one: the expansion's neighbours are scattered in memory.
    """
    i = 0
    while i + 4 <= count:
        r0, r1, r2, r3 = rows[i], rows[i + 1], rows[i + 2], rows[i + 3]
        a0 = np.float32(0.0)
        a1 = np.float32(0.0)
        a2 = np.float32(0.0)
        a3 = np.float32(0.0)
        if inner_product:
            for j in range(query.shape[0]):
                q = query[j]
                a0 += q * vectors[r0, j]
                a1 += q * vectors[r1, j]
                a2 += q * vectors[r2, j]
                a3 += q * vectors[r3, j]
            out[i], out[i + 1], out[i + 2], out[i + 3] = -a0, -a1, -a2, -a3
        else:
            for j in range(query.shape[0]):
                q = query[j]
                d0 = q - vectors[r0, j]
                d1 = q - vectors[r1, j]
                d2 = q - vectors[r2, j]
                d3 = q - vectors[r3, j]
                a0 += d0 * d0
                a1 += d1 * d1
                a2 += d2 * d2
                a3 += d3 * d3
            out[i], out[i + 1], out[i + 2], out[i + 3] = a0, a1, a2, a3
        i += 4
    while i < count:
        out[i] = _distance(query, vectors, rows[i], inner_product)
        i += 1


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


@njit(cache=True, inline="always")
def _is_allowed(allowed, filtered, ident):  # type: ignore[no-untyped-def]
    """faiss ``IDSelectorBitmap::is_member``: bit ``ident % 8`` of byte ``ident // 8``, none past the end."""
    if not filtered:
        return True
    byte = ident >> 3
    return byte < allowed.shape[0] and (allowed[byte] >> (ident & 7)) & 1 == 1


@njit(cache=True)
def _offer_result(result_dis, result_ids, val, ident, allowed, filtered):  # type: ignore[no-untyped-def]
    if result_dis[0] > val and _is_allowed(allowed, filtered, ident):
        _heap_replace_top(result_dis.shape[0], result_dis, result_ids, val, ident)


@njit(cache=True, fastmath=True)
def _pop_min(size, queue_dis, queue_ids):  # type: ignore[no-untyped-def]
    """faiss ``MinimaxHeap::pop_min``'s choice: the smallest valid entry, the highest slot on ties.

    The smallest value first, in a branch-free pass the compiler vectorises (faiss uses SIMD
    here too), then the highest valid slot holding it: the same slot as one scan from the top
    that keeps the first strictly smaller entry, at a fraction of its branches.
    """
    smallest = np.float32(np.inf)
    for i in range(size):
        value = queue_dis[i] if queue_ids[i] != -1 else np.float32(np.inf)
        smallest = min(smallest, value)
    for i in range(size - 1, -1, -1):
        if queue_ids[i] != -1 and queue_dis[i] == smallest:
            return i
    return -1


@njit(cache=True, fastmath=True)
def _count_below(size, queue_dis, threshold):  # type: ignore[no-untyped-def]
    """Entries of the queue, popped ones included (as faiss counts), strictly below ``threshold``."""
    below = 0
    for i in range(size):
        below += queue_dis[i] < threshold
    return below


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
    allowed,
    filtered,
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
    _offer_result(result_dis, result_ids, d_nearest, nearest, allowed, filtered)
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
    allowed,
    filtered,
):
    """Expand at most ``budget`` level-0 nodes; return True once the search has finished.

    A node's unvisited neighbours are gathered first and their distances computed together, then
    offered in neighbour order: the same order, so the same heaps, as one at a time.
    """
    expanded = 0
    width = cum_neighbors[1] - cum_neighbors[0]
    pending = np.empty(width, dtype=np.int64)
    pending_dis = np.empty(width, dtype=np.float32)
    while state[QUEUE_VALID] > 0 and expanded < budget:
        size = state[QUEUE_SIZE]
        best = _pop_min(size, queue_dis, queue_ids)
        best_dis = queue_dis[best]
        node = queue_ids[best]
        queue_ids[best] = -1
        state[QUEUE_VALID] -= 1
        if _count_below(size, queue_dis, best_dis) >= ef_search:
            state[FINISHED] = 1
            return True
        count = 0
        for j in range(offsets[node] + cum_neighbors[0], offsets[node] + cum_neighbors[1]):
            other = neighbors[j]
            if other < 0:
                break
            if visited[other]:
                continue
            visited[other] = 1
            pending[count] = other
            count += 1
        _distances(query, vectors, pending, count, pending_dis, inner_product)
        for i in range(count):
            _offer_result(result_dis, result_ids, pending_dis[i], pending[i], allowed, filtered)
            _queue_push(state, queue_dis, queue_ids, pending[i], pending_dis[i])
        expanded += 1
        state[EXPANSIONS] += 1
    if state[QUEUE_VALID] == 0:
        state[FINISHED] = 1
    return state[FINISHED] == 1


@njit(cache=True)
def sorted_results(result_dis, result_ids, inner_product, worst, out_dis, out_ids):  # type: ignore[no-untyped-def]
    """The result heap best first into ``out_*``, as faiss reports it: by (distance, id), inner
    products as similarities, missing slots (id -1) at ``worst`` (negated for inner product).

    One compiled call per stage instead of numpy's sort, indexing and masks: a staged search
    reports its running top-k after every stage, so this is paid on every stage of every query.
    """
    k = result_dis.shape[0]
    for i in range(k):
        out_dis[i] = result_dis[i]
        out_ids[i] = result_ids[i]
    for i in range(1, k):  # insertion sort: k is small
        value, ident = out_dis[i], out_ids[i]
        j = i - 1
        while j >= 0 and _after(out_dis[j], value, out_ids[j], ident):
            out_dis[j + 1] = out_dis[j]
            out_ids[j + 1] = out_ids[j]
            j -= 1
        out_dis[j + 1] = value
        out_ids[j + 1] = ident
    for i in range(k):
        if out_ids[i] < 0:
            out_dis[i] = -worst if inner_product else worst
        elif inner_product:
            out_dis[i] = -out_dis[i]
