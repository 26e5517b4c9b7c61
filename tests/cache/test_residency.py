from specrag.cache.residency import BlockLRU, chain_block_keys


def test_chain_keys_depend_on_the_whole_prefix_and_ignore_the_partial_tail() -> None:
    a = chain_block_keys([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    b = chain_block_keys([0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert len(a) == 2 and len(b) == 2
    assert a[1] != b[1]  # same second block, different first block
    assert chain_block_keys([5, 6, 7, 8], 4, a[0]) == a[1:]


def test_lru_evicts_least_recent_and_a_prompts_tail_first() -> None:
    lru = BlockLRU(3)
    added, evicted = lru.touch([1, 2])
    assert (added, evicted) == ([1, 2], [])
    added, evicted = lru.touch([3, 4])
    assert added == [3, 4]
    assert evicted == [2]  # 1 was touched after 2 (tail first), so 2 is older
    assert lru.leading_cached([1, 3, 4]) == 3
    assert lru.leading_cached([2, 3]) == 0
