import itertools
import random
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.sparse import csr_matrix

from specrag.cache import DocId, plan_batch
from specrag.cache.batch import context_distances
from specrag.errors import InvalidInputError


def test_distance_matches_the_formula_pair_by_pair() -> None:
    rng = random.Random(3)
    contexts = [rng.sample(range(25), rng.randint(1, 7)) for _ in range(30)]
    vocab: dict[int, int] = {}
    rows, cols, pos = [], [], []
    for r, ctx in enumerate(contexts):
        for p, d in enumerate(ctx):
            rows.append(r)
            cols.append(vocab.setdefault(d, len(vocab)))
            pos.append(p + 1.0)
    x = csr_matrix((np.ones(len(rows)), (rows, cols)))
    got = context_distances(x, csr_matrix((pos, (rows, cols))), alpha=0.01)
    expected = []
    for i, a in enumerate(contexts):
        for b in contexts[i + 1 :]:
            shared = set(a) & set(b)
            if not shared:
                expected.append(1.0)
                continue
            shift = np.sqrt(sum((a.index(d) - b.index(d)) ** 2 for d in shared) / len(shared))
            expected.append(1 - len(shared) / max(len(a), len(b)) + 0.01 * shift)
    np.testing.assert_allclose(got, expected, atol=1e-12)


def test_plan_groups_sharing_contexts_and_orders_shared_documents_first() -> None:
    contexts = [[2, 1, 3], [5, 7, 8], [2, 6, 1], [4, 1, 0], [1, 9, 2], [2, 1, 3]]
    plan = plan_batch(contexts)
    assert sorted(plan.order) == list(range(len(contexts)))
    for original, reordered in zip(contexts, plan.contexts, strict=True):
        assert sorted(original) == sorted(reordered)
    # every context holding {1, 2} starts with the same two documents, and they run back to back
    with_12 = [i for i, c in enumerate(contexts) if {1, 2} <= set(c)]
    assert len({plan.contexts[i][:2] for i in with_12}) == 1
    positions = sorted(plan.order.index(i) for i in with_12)
    assert positions == list(range(positions[0], positions[0] + len(with_12)))
    # the identical contexts 0 and 5 run consecutively with the same order and path
    assert abs(plan.order.index(0) - plan.order.index(5)) == 1
    assert plan.contexts[0] == plan.contexts[5]
    # the unrelated context keeps its retrieval order
    assert plan.contexts[1] == (5, 7, 8)


def test_plan_maximises_prefix_sharing_between_neighbours() -> None:
    rng = random.Random(0)
    topics = [list(range(t * 10, t * 10 + 10)) for t in range(5)]
    contexts = [rng.sample(rng.choice(topics), 5) for _ in range(60)]
    plan = plan_batch(contexts)

    def shared_prefix(a: tuple[DocId, ...], b: tuple[DocId, ...]) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    def neighbour_sharing(order: list[int], docs: list[tuple[DocId, ...]]) -> int:
        return sum(shared_prefix(docs[i], docs[j]) for i, j in itertools.pairwise(order))

    planned = neighbour_sharing(list(plan.order), list(plan.contexts))
    baseline = neighbour_sharing(list(range(60)), [tuple(c) for c in contexts])
    assert planned > baseline + 30


def trie_nodes(orders: Sequence[tuple[DocId, ...]]) -> int:
    """Distinct prefixes: what a prefix cache must compute once each (fewer = more reuse)."""
    return len({order[: i + 1] for order in orders for i in range(len(order))})


contexts_strategy = st.lists(
    st.lists(st.integers(0, 15), min_size=1, max_size=6, unique=True), min_size=1, max_size=40
)


@settings(max_examples=60, deadline=None)
@given(contexts_strategy)
def test_refinement_never_adds_prefixes_and_the_schedule_runs_every_subtree_contiguously(
    contexts: list[list[int]],
) -> None:
    unrefined = plan_batch(contexts, refine_passes=0)
    plan = plan_batch(contexts, refine_passes=2)
    assert sorted(plan.order) == list(range(len(contexts)))
    for original, reordered in zip(contexts, plan.contexts, strict=True):
        assert sorted(original) == sorted(reordered)
    assert trie_nodes(list(plan.contexts)) <= trie_nodes(list(unrefined.contexts))
    # depth first: the requests sharing any prefix run back to back, and a prefix's own request
    # (if it is one) runs before its extensions
    schedule = [plan.contexts[i] for i in plan.order]
    for prefix in {order[: i + 1] for order in schedule for i in range(len(order))}:
        positions = [p for p, order in enumerate(schedule) if order[: len(prefix)] == prefix]
        assert positions == list(range(positions[0], positions[-1] + 1))
        exact = [p for p in positions if schedule[p] == prefix]
        assert all(p <= positions[0] + len(exact) - 1 for p in exact)


def test_distance_without_the_positional_term_counts_shared_documents_only() -> None:
    # contexts [1, 2, 3], [3, 2, 1], [4, 5], [1, 9]: rows of documents with their positions
    x = csr_matrix(([1.0] * 10, ([0, 0, 0, 1, 1, 1, 2, 2, 3, 3], [1, 2, 3, 1, 2, 3, 4, 5, 1, 9])))
    positions = csr_matrix(([1.0, 2, 3, 3, 2, 1, 1, 2, 1, 2], x.nonzero()))
    np.testing.assert_allclose(
        context_distances(x, positions, alpha=0.0), [0.0, 1.0, 1 - 1 / 3, 1.0, 1 - 1 / 3, 1.0]
    )
    assert context_distances(x, positions, alpha=0.5)[0] > 0.0  # same documents, other order


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 40), max_size=8, unique=True), min_size=2, max_size=40),
    st.booleans(),
)
def test_distance_without_the_positional_term_is_exact_whether_most_pairs_share_or_few(
    contexts: list[list[int]], one_popular_document: bool
) -> None:
    """The dense row blocks (most pairs share a document) and the pair lists (few do) give the
    same bits as the formula, empty contexts included."""
    if one_popular_document:
        contexts = [[99, *ctx] for ctx in contexts]
    vocab: dict[int, int] = {}
    rows = [r for r, ctx in enumerate(contexts) for _ in ctx]
    cols = [vocab.setdefault(d, len(vocab)) for ctx in contexts for d in ctx]
    shape = (len(contexts), max(len(vocab), 1))
    x = csr_matrix((np.ones(len(rows)), (rows, cols)), shape=shape)
    expected = [
        1.0 - len(set(a) & set(b)) / max(len(a), len(b)) if set(a) & set(b) else 1.0
        for i, a in enumerate(contexts)
        for b in contexts[i + 1 :]
    ]
    np.testing.assert_array_equal(context_distances(x, x, alpha=0.0), expected)


def test_bad_parameters_are_rejected() -> None:
    with pytest.raises(InvalidInputError):
        plan_batch([[1, 2]], alpha=-1.0)
    with pytest.raises(InvalidInputError):
        plan_batch([[1, 1]])
