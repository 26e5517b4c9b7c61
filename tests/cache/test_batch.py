import itertools
import random

import numpy as np
from scipy.sparse import csr_matrix

from specrag.cache import plan_batch
from specrag.cache.batch import context_distances


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

    def shared_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    def neighbour_sharing(order: list[int], docs: list[tuple[int, ...]]) -> int:
        return sum(shared_prefix(docs[i], docs[j]) for i, j in itertools.pairwise(order))

    planned = neighbour_sharing(list(plan.order), list(plan.contexts))
    baseline = neighbour_sharing(list(range(60)), [tuple(c) for c in contexts])
    assert planned > baseline + 30
