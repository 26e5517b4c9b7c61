import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.ordering.oracle import MyopicOracleOrder
from specrag.cache import POLICY_NAMES, KnowledgeTree, get_policy
from specrag.cache.residency import chain_block_keys
from specrag.errors import InvalidInputError
from tests.helpers.tree import BLOCK, FakeEngine, layout, served_tree

DOCS = range(7)
served_orders = st.lists(
    st.permutations(DOCS).flatmap(lambda p: st.integers(1, 5).map(lambda n: tuple(p[:n]))), max_size=25
)
requests = st.lists(st.sampled_from(DOCS), min_size=0, max_size=5, unique=True)


def build(orders: list[tuple[int, ...]], evictions: list[int]) -> tuple[KnowledgeTree, FakeEngine]:
    """A tree that followed an engine through served prompts and some evictions."""
    tree, engine = served_tree(*orders)
    for pick in evictions:
        if engine.hash_of:
            keys = list(engine.hash_of)
            tree.apply_events(engine.evict([keys[pick % len(keys)]]))
    return tree, engine


def brute_force_best(engine: FakeEngine, request: list[int]) -> tuple[int, int]:
    return max(engine.cached(perm) for perm in itertools.permutations(request))


@settings(max_examples=80, deadline=None)
@given(served_orders, st.lists(st.integers(0, 1000), max_size=8), requests)
def test_exact_reuses_the_most_any_order_can_for_the_request_and_never_loses_to_greedy(
    orders: list[tuple[int, ...]], evictions: list[int], request: list[int]
) -> None:
    tree, engine = build(orders, evictions)
    exact = get_policy("exact").order(tree, request)
    greedy = get_policy("greedy").order(tree, request)
    best = brute_force_best(engine, request)
    assert engine.cached(exact.doc_ids) == best  # on the engine's ground truth, not the tree's
    assert (exact.cached.tokens, exact.cached.docs) == best  # and the tree predicted it
    assert engine.cached(exact.doc_ids) >= engine.cached(greedy.doc_ids)
    oracle = MyopicOracleOrder().order(tree, request)
    assert engine.cached(oracle.doc_ids) == best


@settings(max_examples=60, deadline=None)
@given(served_orders, requests, st.sampled_from(POLICY_NAMES))
def test_every_policy_returns_a_permutation(
    orders: list[tuple[int, ...]], request: list[int], name: str
) -> None:
    tree, _ = build(orders, [])
    result = get_policy(name).order(tree, request)
    assert sorted(result.doc_ids) == sorted(request)
    assert result.cached == tree.cached_prefix(result.doc_ids)


def test_exact_finds_a_cached_path_that_greedy_misses() -> None:
    # greedy takes 2 (first in rank order with a resident child) and stops; exact finds 4 -> 6 -> 8
    tree, _ = build([(2, 5), (4, 6, 8)], [])
    request = [2, 4, 6, 8]
    assert get_policy("greedy").order(tree, request).doc_ids[:1] == (2,)
    exact = get_policy("exact").order(tree, request)
    assert exact.doc_ids[:3] == (4, 6, 8)
    assert exact.cached.docs == 2  # document 8 ends mid-block: its last block holds question tokens


def test_exact_puts_a_partly_evicted_document_next_for_its_leading_blocks() -> None:
    tree, engine = build([(4, 2)], [])
    prompt = layout((4, 2))
    keys = chain_block_keys(prompt.token_ids, BLOCK)
    doc2 = prompt.segments[2]
    tree.apply_events(engine.evict([keys[doc2.end // BLOCK - 1]]))  # doc 2 loses its last block only
    exact = get_policy("exact").order(tree, [6, 2, 4])
    assert exact.doc_ids[:2] == (4, 2)
    assert exact.cached.tokens == engine.cached((4, 2))[0] > engine.cached((4, 6))[0]


def test_the_longest_cached_prefix_comes_first_then_popular_documents() -> None:
    tree, _ = build([(5,), (3, 5), (6, 3)], [])  # served twice: 5 and 3; once: 6
    # both [5] (8 tokens) and [6] (12 tokens) are cached prefixes; 6 wins, then 5 (popular)
    assert get_policy("exact").order(tree, [1, 6, 5, 9]).doc_ids == (6, 5, 1, 9)
    assert get_policy("exact-rank").order(tree, [1, 6, 5, 9]).doc_ids == (6, 1, 5, 9)


@pytest.mark.parametrize("twice", [(1, 3), (3, 1)])
def test_between_cached_paths_of_equal_reuse_exact_takes_the_one_served_more(twice: tuple[int, int]) -> None:
    once = twice[::-1]
    tree, _ = build([once, twice, twice], [])
    assert tree.cached_prefix(once)[:2] == tree.cached_prefix(twice)[:2]  # same tokens and documents
    assert get_policy("exact").order(tree, [1, 3]).doc_ids == twice


def test_myopic_oracle_accepts_an_external_probe() -> None:
    tree, _ = build([(1, 2)], [])
    probed: list[tuple[int, ...]] = []

    def probe(prefix):  # type: ignore[no-untyped-def]
        probed.append(tuple(prefix))
        return tree.cached_prefix(prefix)

    MyopicOracleOrder(probe).order(tree, [2, 1, 3])
    assert (1, 2) in probed and () in probed


def test_unknown_policy_and_duplicate_documents_are_rejected() -> None:
    with pytest.raises(InvalidInputError, match="known"):
        get_policy("fastest")
    tree, _ = build([], [])
    with pytest.raises(InvalidInputError):
        get_policy("exact").order(tree, [1, 1])


def test_the_rest_follows_affinity_not_global_popularity() -> None:
    # 7 is served most (3 times) but never with this request's documents; 1 was served twice,
    # each time with 2 or 3, so after the cached prefix 2 -> 3 it comes before 7
    tree, _ = build([(2, 3), (5, 1, 2), (5, 1, 3), (7, 4), (7, 4), (7, 4)], [])
    assert tree.popularity(7) > tree.popularity(1)
    assert get_policy("exact").order(tree, [7, 1, 3, 2]).doc_ids == (2, 3, 1, 7)
    assert get_policy("exact-rank").order(tree, [7, 1, 3, 2]).doc_ids == (2, 3, 7, 1)


def test_after_an_eviction_exact_takes_the_remembered_path_again() -> None:
    tree, engine = build([(2, 4, 6), (2, 4, 6)], [])
    prompt = layout((2, 4, 6))
    keys = chain_block_keys(prompt.token_ids, BLOCK)
    tree.apply_events(engine.evict(keys[prompt.segments[2].start // BLOCK :]))  # 4 and 6 are gone
    # affinity alone would put 6 before 4 here: served with 8 twice more, so it is more popular
    for order in [(8, 6), (8, 6)]:
        tree.record_served(layout(order))
    ordered = get_policy("exact").order(tree, [6, 4, 2]).doc_ids
    assert ordered == (2, 4, 6)  # the evicted path, re-created, is where later requests will go
    assert get_policy("exact-rank").order(tree, [6, 4, 2]).doc_ids == (2, 4, 6)


def test_a_resident_prefix_is_never_given_up_for_the_remembered_path() -> None:
    tree, _ = build([(1, 2, 3), (1, 2, 3), (1, 2, 3), (5, 3)], [])
    exact = get_policy("exact").order(tree, [3, 5, 2, 1])
    assert exact.doc_ids[:3] == (1, 2, 3)
    assert exact.cached == tree.cached_prefix(exact.doc_ids)


def test_a_document_with_only_its_first_block_left_still_beats_a_fully_cached_shorter_one() -> None:
    # 0 (one token) is cached after 4 and served more; of 2 after 4 only the first block survives,
    # which still reuses more than 0 does
    tree, engine = build([(4, 0), (4, 0), (4, 2)], [])
    prompt = layout((4, 2))
    keys = chain_block_keys(prompt.token_ids, BLOCK)
    doc2 = prompt.segments[2]
    tree.apply_events(engine.evict(keys[doc2.start // BLOCK + 1 : doc2.end // BLOCK]))
    exact = get_policy("exact").order(tree, [0, 2, 4])
    assert exact.doc_ids[:2] == (4, 2)
    assert exact.cached.tokens == engine.cached((4, 2))[0] > engine.cached((4, 0))[0]
