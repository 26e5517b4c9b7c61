"""``exact``'s orders pinned on a seeded trace, so a change meant only to make ordering cheaper
cannot change what it orders.

The trace mixes padded and unpadded documents (a document ending mid-block reuses less than its
span), a bounded capacity model (evicted and partly evicted paths) and an unlimited one. The
digests were taken with the ordering code before it was made cheaper; a change that *means* to
change orders updates them (run this file: ``python -m tests.cache.test_ordering_unchanged``).
"""

from __future__ import annotations

import hashlib
import json
import random

import pytest

from specrag.cache import DocId, KnowledgeTree, build_layout, get_policy

BLOCK = 16
SYSTEM = tuple(range(1, 21))
TOPICS, TOPIC_DOCS, REQUESTS = 6, 14, 240


def _doc_tokens(doc_id: DocId) -> tuple[int, ...]:
    rng = random.Random(doc_id)
    return tuple(rng.randrange(1000, 9000) for _ in range(rng.randrange(1, 70)))


def _trace(seed: int) -> list[list[int]]:
    """Requests of 3-8 documents, most from one topic's pool (earlier documents likelier)."""
    rng = random.Random(seed)
    requests = []
    for _ in range(REQUESTS):
        topic = min(int(rng.expovariate(0.5)), TOPICS - 1)
        pool = range(topic * TOPIC_DOCS, (topic + 1) * TOPIC_DOCS)
        docs: list[int] = []
        size = rng.randrange(3, 9)
        while len(docs) < size:
            rank = min(int(rng.expovariate(0.25)), len(pool) - 1)
            doc = rng.randrange(1000) if rng.random() < 0.1 else pool[rank]
            if doc not in docs:
                docs.append(doc)
        requests.append(docs)
    return requests


def orders_digest(policy_name: str, *, padded: bool, capacity_blocks: int) -> str:
    """Serve the trace in arrival order through a tree on the capacity model; digest every
    ordering (documents and predicted reuse, checked against a walk of the tree)."""
    tree = KnowledgeTree(SYSTEM, block_size=BLOCK, capacity_blocks=capacity_blocks)
    policy = get_policy(policy_name)
    seen = []
    for i, docs in enumerate(_trace(seed=5)):
        ordering = policy.order(tree, docs)
        assert ordering.cached == tree.cached_prefix(ordering.doc_ids)  # the search's own count
        seen.append([list(ordering.doc_ids), list(ordering.cached)])
        layout = build_layout(
            SYSTEM,
            [(d, _doc_tokens(d)) for d in ordering.doc_ids],
            (50_000 + i,),
            block_size=BLOCK if padded else None,
            pad_token_id=0 if padded else None,
        )
        tree.record_served(layout)
    return hashlib.sha256(json.dumps(seen).encode()).hexdigest()[:16]


CASES = [
    (policy, padded, capacity)
    for policy in ("exact", "exact-rank")
    for padded in (True, False)
    for capacity in (80, 1_000_000)
]
PINNED = {
    ("exact", True, 80): "17ca9a27fbf4fd80",
    ("exact", True, 1000000): "04cbc19ca62f89cf",
    ("exact", False, 80): "ca0ae86e876045fd",
    ("exact", False, 1000000): "8cd60cf6dca9835c",
    ("exact-rank", True, 80): "7660fb0666d96fa8",
    ("exact-rank", True, 1000000): "5cd0ee95e9dd7cb0",
    ("exact-rank", False, 80): "5e72dd929b23d28f",
    ("exact-rank", False, 1000000): "f4e30f2271e17297",
}


@pytest.mark.parametrize(("policy", "padded", "capacity"), CASES)
def test_orders_are_those_of_the_pinned_version(policy: str, padded: bool, capacity: int) -> None:
    assert orders_digest(policy, padded=padded, capacity_blocks=capacity) == PINNED[policy, padded, capacity]


if __name__ == "__main__":
    for case in CASES:
        print(f"    {case!r}: {orders_digest(case[0], padded=case[1], capacity_blocks=case[2])!r},")
