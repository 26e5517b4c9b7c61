import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specrag.cache import AllBlocksCleared, BlockStored, KnowledgeTree, PrefixMatch, get_policy
from specrag.cache import tree as tree_module
from specrag.cache.layout import PromptLayout, build_layout
from specrag.cache.residency import chain_block_keys
from specrag.errors import InvalidInputError
from tests.helpers.tree import BLOCK, QUESTION_TOKENS, SYSTEM, FakeEngine, doc_tokens, layout, served_tree


def test_cold_tree_knows_nothing_is_cached() -> None:
    tree, _ = served_tree()
    assert not tree.system_prompt_resident()
    assert tree.cached_prefix([0, 1]).tokens == 0


def test_events_make_the_served_path_resident_and_evictions_undo_it() -> None:
    tree, engine = served_tree((3, 1, 2))
    assert tree.system_prompt_resident()
    match = tree.cached_prefix([3, 1, 2])
    assert (match.tokens, match.docs) == engine.cached((3, 1, 2)) == (28, 3)
    assert tree.cached_prefix([1, 3]).docs == 0
    # evict the block that completes inside document 1 (second on the path)
    prompt = layout((3, 1, 2))
    keys = chain_block_keys(prompt.token_ids, BLOCK)
    doc1 = prompt.segments[2]
    victim = keys[doc1.end // BLOCK - 1]
    tree.apply_events(engine.evict([victim]))
    match = tree.cached_prefix([3, 1, 2])
    assert (match.tokens, match.docs) == engine.cached((3, 1, 2)) == (12, 1)
    tree.apply_events([AllBlocksCleared()])
    assert not tree.system_prompt_resident()
    assert tree.cached_prefix([3, 1, 2]).tokens == 0


def test_a_document_ending_mid_block_is_cached_only_up_to_its_last_full_block() -> None:
    tree, engine = served_tree((2, 1))  # doc 2 has 11 tokens: the path ends mid-block at token 17
    other = tree.cached_prefix([2, 4])
    assert (other.tokens, other.docs) == engine.cached((2, 4)) == (16, 0)


def test_capacity_model_evicts_when_events_are_unavailable() -> None:
    tree, _ = served_tree((2, 4), (6, 8), (4, 6), capacity_blocks=10)  # 7 + 6 + 7 blocks
    assert tree.uses_capacity_model
    assert tree.stored_blocks == 10
    assert tree.cached_prefix([2, 4]) == PrefixMatch(0, 4)  # only the shared system block survived
    assert tree.cached_prefix([4, 6]).tokens == 24


def test_first_event_retires_the_capacity_model() -> None:
    tree, engine = served_tree((2, 4), capacity_blocks=100)
    assert tree.cached_prefix([2, 4]).tokens == 24
    prompt = layout((5,))
    tree.apply_events(engine.serve(prompt))  # the engine's events may arrive before record_served
    tree.record_served(prompt)
    assert not tree.uses_capacity_model
    assert tree.cached_prefix([2, 4]) == PrefixMatch(0, 4)  # only what the engine reported counts now
    assert tree.cached_prefix([5]).tokens == 8


def test_a_different_system_prompt_is_rejected() -> None:
    tree = KnowledgeTree((7, 7, 7), block_size=BLOCK)
    with pytest.raises(InvalidInputError):
        tree.record_served(layout((1,)))


def test_a_history_laid_out_as_the_prefix_is_not_recorded_as_the_trees_path() -> None:
    """A session's later turn starts with its history: its documents are not at a first turn's positions."""
    tree, engine = served_tree((1, 2))
    first = layout((1, 2))
    history = (*first.token_ids, 50, 51)  # the first turn, then its answer
    later = build_layout(history, [(3, doc_tokens(3))], QUESTION_TOKENS)
    with pytest.raises(InvalidInputError, match="history"):
        tree.record_served(later)
    with pytest.raises(InvalidInputError, match="history"):
        tree.record_prefilled(later)
    with pytest.raises(InvalidInputError, match="history"):
        tree.record_pending(later)
    # Padding of the system prompt alone is still its system prompt.
    padded = build_layout(SYSTEM, [(3, doc_tokens(3))], QUESTION_TOKENS, block_size=BLOCK, pad_token_id=0)
    tree.apply_events(engine.serve(padded))
    tree.record_served(padded)
    assert tree.cached_prefix([3]).tokens > 0


def test_a_prompt_listing_a_document_twice_is_not_recorded() -> None:
    """Ordering relies on no path of the tree holding a document twice."""
    tree = KnowledgeTree(SYSTEM, block_size=BLOCK)
    once = layout((1, 2))
    system, first, second, *rest = once.segments
    twice = PromptLayout(once.token_ids, (system, first, second._replace(doc_id=1), *rest))
    with pytest.raises(InvalidInputError, match="twice"):
        tree.record_served(twice)
    assert len(tree) == 0


def test_mismatched_block_size_in_events_is_rejected() -> None:
    tree = KnowledgeTree(SYSTEM, block_size=8)
    with pytest.raises(InvalidInputError):
        tree.apply_events(FakeEngine().serve(layout((1,))))


operations = st.lists(
    st.one_of(
        st.tuples(
            st.just("serve"),
            st.permutations(range(6)).flatmap(lambda p: st.integers(0, 6).map(lambda n: tuple(p[:n]))),
        ),
        st.tuples(st.just("evict"), st.integers(0, 10_000)),
        st.tuples(st.just("clear"), st.none()),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(operations)
def test_tree_mirrors_the_engine_under_random_event_streams(ops: list[tuple[str, object]]) -> None:
    tree, engine = served_tree()
    for kind, arg in ops:
        if kind == "serve":
            assert isinstance(arg, tuple)
            prompt = layout(arg)
            tree.record_served(prompt)
            tree.apply_events(engine.serve(prompt))
        elif kind == "evict" and engine.hash_of:
            assert isinstance(arg, int)
            keys = list(engine.hash_of)
            tree.apply_events(engine.evict([keys[arg % len(keys)]]))
        elif kind == "clear":
            engine.hash_of.clear()
            tree.apply_events([AllBlocksCleared()])
    stored = set(engine.hash_of)
    nodes = list(tree.nodes())
    assert len(nodes) == len(tree) + 1
    for node in nodes:
        assert node.missing == sum(1 for key in node.keys if key not in stored)
        for doc_id, child in node.children.items():
            assert child.parent is node and child.doc_id == doc_id and child.start == node.end
    for order in itertools.permutations(range(4), 3):
        match = tree.cached_prefix(order)
        assert (match.tokens, match.docs) == engine.cached(order)


@settings(max_examples=15, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 200), min_size=1, max_size=6, unique=True), min_size=150, max_size=300)
)
def test_memory_stays_bounded_under_a_long_stream(requests: list[list[int]]) -> None:
    tree = KnowledgeTree(SYSTEM, block_size=BLOCK, capacity_blocks=40, max_nodes=30, max_docs=20)
    for order in requests:
        tree.record_served(layout(order))
        assert len(tree) <= 30
        assert tree.stored_blocks <= 40
        assert sum(1 for _ in tree.nodes()) == len(tree) + 1
    assert sum(1 for d in range(201) if tree.popularity(d) > 0) <= 20


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.integers(0, 12), min_size=1, max_size=5, unique=True), max_size=30))
def test_companions_count_the_prompts_two_documents_shared(requests: list[list[int]]) -> None:
    tree = KnowledgeTree(SYSTEM, block_size=BLOCK)
    for order in requests:
        tree.record_served(layout(order))
    for a in range(13):
        assert tree.companions(a).get(a, 0) == tree.popularity(a)
        for b in range(13):
            together = sum(1 for order in requests if a in order and b in order)
            assert tree.companions(a).get(b, 0) == together
    assert tree.companion_rows(range(13)) == [tree.companions(a) for a in range(13)]


def test_companions_stay_bounded_and_keep_the_most_frequent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tree_module, "MAX_COMPANIONS", 8)
    tree = KnowledgeTree(SYSTEM, block_size=BLOCK)
    for _ in range(3):
        tree.record_served(layout((0, 1)))  # 1 is 0's frequent companion
    for other in range(2, 40):
        tree.record_served(layout((0, other)))
        assert len(tree.companions(0)) <= 8
    assert tree.companions(0)[1] == 3 and tree.companions(0)[0] == 41


def test_a_prefilled_prompt_counts_as_cached_before_its_events_and_they_do_not_double_it() -> None:
    tree, engine = served_tree((2, 4))  # a tree that follows events
    prompt = layout((6, 8))
    events = engine.serve(prompt)  # the engine prefilled it; its events are still on the way
    tree.record_served(prompt)
    assert tree.cached_prefix([6, 8]).tokens < engine.cached((6, 8))[0]
    tree.record_prefilled(prompt)  # at the first token
    match = tree.cached_prefix([6, 8])
    assert (match.tokens, match.docs) == engine.cached((6, 8))
    tree.apply_events(events)  # the events confirm the blocks: one reference each, not two
    keys = chain_block_keys(prompt.token_ids, BLOCK)
    evicted = keys[prompt.segments[1].end // BLOCK - 1]  # the last full block of document 6
    tree.apply_events(engine.evict([evicted]))
    assert tree.cached_prefix([6, 8]).docs == engine.cached((6, 8))[1] == 0


def test_a_pending_prompts_blocks_count_as_their_events_arrive_and_its_use_at_its_first_token() -> None:
    """Submitted, not yet served: a chunked prefill stores its leading blocks first, and a prompt
    placed meanwhile over the same documents in the same order reuses them."""
    tree, engine = served_tree((2, 4))  # a tree that follows events
    prompt = layout((6, 8))
    tree.record_pending(prompt)
    assert tree.cached_prefix([6, 8]).tokens == BLOCK  # the system prompt's one full block
    events = engine.serve(prompt)  # one event per new block, in prompt order
    tree.apply_events(events[:2])  # the first chunk: the next two blocks
    assert tree.cached_prefix([6, 8]).tokens == 3 * BLOCK
    assert tree.cached_prefix([8, 6]).tokens == BLOCK  # another order has no such path
    assert tree.popularity(6) == 0 and not tree.companions(6)  # its use is not counted yet
    tree.record_served(prompt)  # its first token
    assert tree.popularity(6) == 1 and tree.companions(6)[8] == 1


def test_prefill_expectations_are_dropped_with_the_engines_cache() -> None:
    tree, _ = served_tree((2, 4))
    prompt = layout((6,))
    tree.record_served(prompt)
    tree.record_prefilled(prompt)
    tree.engine_cache_cleared()
    assert tree.cached_prefix([6]).tokens == 0 and not tree.system_prompt_resident()


def test_a_salted_prompt_predicts_nothing_in_the_unsalted_tree() -> None:
    """A document-KV (TurboRAG) request ran under its own cache salt: its unsalted keys were never
    stored, and no event would ever confirm or remove them."""
    tree, _ = served_tree((2, 4))
    prompt = layout((6, 8))
    tree.record_served(prompt)
    tree.record_prefilled(prompt, salted=True)
    assert tree.cached_prefix([6, 8]).docs == 0 and tree.unconfirmed_predictions == 0


def test_a_batch_with_a_bad_event_is_applied_not_at_all() -> None:
    tree, engine = served_tree((2, 4))
    before = tree.resident_hashes()
    good = engine.serve(layout((6,)))
    bad = BlockStored((1,), None, (1, 2, 3), 3)  # another block size: refused
    with pytest.raises(InvalidInputError, match="block size"):
        tree.apply_events([*good, bad])
    assert tree.resident_hashes() == before


def test_the_version_rises_with_every_change_an_ordering_reads() -> None:
    """A query keeps an ordering while the version stays: every change must move it, reads none."""
    tree = KnowledgeTree(SYSTEM, block_size=BLOCK)
    engine = FakeEngine()
    now = [0.0]
    tree._residency._clock = lambda: now[0]  # a prediction's deadline, moved by hand
    prompt = layout([1, 2])
    seen = [tree.version]

    def moved() -> None:
        assert tree.version > seen[-1]
        seen.append(tree.version)

    tree.record_pending(prompt)
    moved()
    tree.record_prefilled(prompt)  # predicted stored until their events come
    moved()
    tree.cached_prefix((1, 2))
    get_policy("exact").order(tree, (2, 1))
    assert tree.version == seen[-1]  # reading changes nothing
    now[0] = 1e9
    tree.expire_predictions()  # every read of the stored blocks expires them first
    moved()
    tree.record_served(prompt)
    moved()
    tree.apply_events(engine.serve(prompt))
    moved()
    tree.engine_cache_cleared()
    moved()
