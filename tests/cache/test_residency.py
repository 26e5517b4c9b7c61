import pytest

from specrag.cache.events import BlockRemoved, BlockStored
from specrag.cache.residency import BlockPool, BlockResidency, ResidencyCounts, chain_block_keys
from specrag.errors import InvalidInputError


def test_chain_keys_depend_on_the_whole_prefix_and_ignore_the_partial_tail() -> None:
    a = chain_block_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    b = chain_block_keys([0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and len(b) == 2
    assert a[1] != b[1]  # same second block, different first block
    assert chain_block_keys([5, 6, 7, 8], 4, a[0]) == a[1:]


def test_pool_evicts_least_recent_and_a_prompts_tail_first() -> None:
    pool = BlockPool(3)
    served = pool.serve([1, 2])
    assert (served.cached_blocks, served.stored, served.evicted) == (0, [1, 2], [])
    served = pool.serve([3, 4])
    assert served.stored == [3, 4]
    assert served.evicted == [2]  # 1 was freed after 2 (tail first), so 2 is older
    assert pool.leading_cached([1, 3, 4]) == 3
    assert pool.leading_cached([2, 3]) == 0


def test_a_hit_refreshes_recency_and_is_not_stored_again() -> None:
    pool = BlockPool(4)
    pool.serve([1, 2])
    pool.serve([3, 4])
    served = pool.serve([1, 2, 5])  # reuses 1, 2; 5 must evict the oldest free block: 4
    assert (served.cached_blocks, served.stored, served.evicted) == (2, [5], [4])
    assert [key in pool for key in (1, 2, 3, 4, 5)] == [True, True, True, False, True]


def test_blocks_in_use_are_never_evicted() -> None:
    pool = BlockPool(3)
    pool.serve([1])
    running, evicted = pool.allocate(2)  # a running request holds the two never-used blocks
    assert evicted == []
    assert pool.register(running[0], 10) and pool.register(running[1], 11)
    assert pool.in_use == 2
    assert not pool.can_take((), 2)  # only the block cached for key 1 is free
    more, evicted = pool.allocate(1)
    assert evicted == [1]  # the free cached block goes, the running request's blocks stay
    assert 10 in pool and 11 in pool
    assert not pool.can_take((), 1)
    assert not pool.clear()  # like vLLM's reset: refused while blocks are in use
    pool.release(running + more)
    assert pool.in_use == 0 and pool.clear() and len(pool) == 0


def test_a_block_shared_by_two_requests_stays_in_use_until_both_free_it() -> None:
    pool = BlockPool(2)
    pool.serve([1])
    first, second = pool.take_cached([1]), pool.take_cached([1])
    pool.release(first)
    assert pool.in_use == 1 and not pool.can_take((), 2)
    _, evicted = pool.allocate(1)
    assert evicted == [] and 1 in pool
    pool.release(second)
    assert pool.in_use == 1  # only the block just allocated


def test_reusing_a_free_cached_block_takes_a_free_slot() -> None:
    pool = BlockPool(2)
    pool.serve([1, 2])
    assert pool.can_take([1, 2], 0)
    assert not pool.can_take([1, 2], 1)  # both free blocks are the hit itself
    blocks = pool.take_cached([1])
    assert pool.in_use == 1 and not pool.can_take((), 2)
    pool.release(blocks)
    assert pool.in_use == 0


def test_a_key_computed_twice_keeps_its_first_block() -> None:
    pool = BlockPool(4)
    first, _ = pool.allocate(1)
    second, _ = pool.allocate(1)
    assert pool.register(first[0], 7)
    assert not pool.register(second[0], 7)
    pool.release(first + second)
    assert len(pool) == 1 and pool.leading_cached([7]) == 1


def test_a_prompt_longer_than_the_pool_keeps_its_first_blocks() -> None:
    pool = BlockPool(3)
    pool.serve([9])
    served = pool.serve([1, 2, 3, 4, 5])
    assert served.stored == [1, 2, 3, 4, 5]
    assert served.evicted == [9, 5, 4]  # the older block, then the prompt's tail, last first
    assert [key in pool for key in (1, 2, 3, 4, 5)] == [True, True, True, False, False]
    assert pool.in_use == 0


def test_an_unlimited_pool_never_evicts() -> None:
    pool = BlockPool(None)
    for start in range(0, 1000, 10):
        assert pool.serve(list(range(start, start + 10))).evicted == []
    assert len(pool) == 1000 and pool.in_use == 0
    assert pool.serve(list(range(10))).cached_blocks == 10


@pytest.mark.parametrize("capacity", [0, -1])
def test_capacity_must_be_positive(capacity: int) -> None:
    with pytest.raises(InvalidInputError, match="capacity_blocks"):
        BlockPool(capacity)


def test_the_stored_view_follows_stores_and_removals() -> None:
    residency = BlockResidency(4, lambda key, stored: None)
    stored = residency.stored  # taken once, read later: it must stay live
    residency.store(7)
    residency.store(7)  # a second reference
    residency.remove(7)
    assert 7 in stored
    residency.remove(7)
    assert 7 not in stored
    residency.store(8)
    residency.clear()
    assert 8 not in stored


def test_salted_blocks_are_another_cache_than_unsalted_ones() -> None:
    """A turbo request's blocks (salted: loaded documents) never count for an unsalted prompt."""
    from specrag.cache.residency import salted_root

    residency = BlockResidency(2, lambda key, stored: None)
    tokens = (1, 2, 3, 4)
    residency.apply(BlockStored((11, 12), None, tokens, 2, cache_salt="specrag-turbo"))
    assert residency.leading_stored(chain_block_keys(tokens, 2)) == 0
    assert residency.leading_stored(chain_block_keys(tokens, 2, salted_root("specrag-turbo"))) == 2
    residency.apply(BlockStored((21, 22), None, tokens, 2))
    assert residency.leading_stored(chain_block_keys(tokens, 2)) == 2
    assert salted_root("a") == salted_root("a") != salted_root("b")


def stored(
    hashes: tuple[int, ...], parent: int | None, tokens: tuple[int, ...], group: int = 0
) -> BlockStored:
    return BlockStored(hashes, parent, tokens, 2, group_idx=group, medium="GPU")


def removed(hashes: tuple[int, ...], group: int = 0) -> BlockRemoved:
    return BlockRemoved(hashes, group_idx=group, medium="GPU")


def test_a_hash_stays_resident_while_any_copy_of_it_does() -> None:
    """vLLM publishes one BlockStored per physical copy and one BlockRemoved per freed copy."""
    residency = BlockResidency(2, lambda key, stored: None)
    keys = chain_block_keys((1, 2, 3, 4), 2)
    residency.apply(stored((11, 12), None, (1, 2, 3, 4)))
    residency.apply(stored((11,), None, (1, 2)))  # a second request computed the first block too
    residency.apply(removed((11,)))  # one copy evicted
    assert residency.leading_stored(keys) == 2 and (0, "GPU", 11) in residency.resident_hashes()
    residency.apply(stored((13,), 11, (5, 6)))  # a chain extending it is still keyed
    assert residency.leading_stored(chain_block_keys((1, 2, 5, 6), 2)) == 2
    residency.apply(removed((11,)))
    assert residency.leading_stored(keys) == 0
    assert residency.counts.duplicate_copies == 1


def test_copies_are_counted_per_group_and_an_unknown_removal_only_counted() -> None:
    residency = BlockResidency(2, lambda key, stored: None)
    residency.apply(stored((11,), None, (1, 2), group=0))
    residency.apply(stored((11,), None, (1, 2), group=1))  # another KV-cache group: not a duplicate
    residency.apply(removed((11,), group=1))
    residency.apply(removed((99,)))  # never stored (history before the mirror listened)
    assert residency.resident_hashes() == {(0, "GPU", 11)}
    assert residency.counts == ResidencyCounts(duplicate_copies=0, unknown_removals=1)


def test_a_prediction_no_event_confirms_is_dropped_after_its_time_and_the_set_is_bounded() -> None:
    clock = [0.0]
    changes: list[tuple[int, bool]] = []
    residency = BlockResidency(
        2,
        lambda key, stored: changes.append((key, stored)),
        prediction_ttl_s=5.0,
        max_predictions=2,
        clock=lambda: clock[0],
    )
    residency.expect(1)
    residency.expect(2)
    residency.expect(3)  # past the bound: the oldest goes
    assert not residency.is_stored(1) and residency.predictions == 2
    clock[0] = 5.0
    residency.expire_predictions()
    assert residency.predictions == 0 and len(residency) == 0
    assert residency.counts.expired_predictions == 3
    key = chain_block_keys((1, 2), 2)[0]
    residency.expect(key)
    residency.apply(stored((11,), None, (1, 2)))  # confirmed: one reference, no longer a prediction
    clock[0] = 100.0
    residency.expire_predictions()
    assert residency.is_stored(key) and residency.predictions == 0


def test_a_bad_event_is_refused_before_anything_is_applied() -> None:
    residency = BlockResidency(2, lambda key, stored: None)
    with pytest.raises(InvalidInputError, match="block size"):
        residency.check(BlockStored((1,), None, (1, 2, 3), 3))
    with pytest.raises(InvalidInputError, match="token count"):
        residency.check(BlockStored((1,), None, (1, 2, 3), 2))
