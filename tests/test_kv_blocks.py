"""The block pool's bookkeeping: tables, the prefix cache (names, sharing, LRU eviction) and admission."""

from __future__ import annotations

from trtbuild.serving.kv_blocks import BlockPool, chain_hashes


def test_a_table_holds_its_positions_and_gives_its_blocks_back() -> None:
    pool = BlockPool(num_blocks=8, block_size=4, prefix_caching=False)
    t = pool.admit(list(range(10)))  # 10 tokens: 3 blocks
    assert t is not None and len(t.blocks) == 3 and len(set(t.blocks)) == 3 and t.cached == 0
    assert (pool.used, pool.free) == (3, 5)
    assert pool.grow(t, 12) and len(t.blocks) == 3  # still inside the third block
    assert pool.grow(t, 13) and len(t.blocks) == 4
    pool.release(t)
    assert (pool.used, pool.free) == (0, 8)


def test_admission_and_growth_refuse_what_the_pool_cannot_hold() -> None:
    pool = BlockPool(num_blocks=4, block_size=4, prefix_caching=False)
    a = pool.admit([1] * 12)
    assert a is not None and pool.free == 1
    assert pool.admit([2] * 5) is None and pool.free == 1  # two blocks wanted: nothing taken
    b = pool.admit([2] * 3)
    assert b is not None and pool.free == 0
    assert not pool.grow(b, 5) and len(b.blocks) == 1  # out of blocks mid-decode: the caller preempts


def test_names_chain_over_everything_before_the_block() -> None:
    x = chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    y = chain_hashes([9, 9, 9, 9, 5, 6, 7, 8], 4)
    assert len(x) == 2 and x[0] != y[0] and x[1] != y[1]  # same tokens in block 2, different prefix
    assert chain_hashes([1, 2, 3, 4, 5, 6, 7], 4) == x[:1]  # only full blocks are named


def test_a_shared_prefix_is_taken_from_the_cache_and_shared_by_reference() -> None:
    pool = BlockPool(num_blocks=16, block_size=4)
    system = list(range(100, 112))  # three full blocks
    first = pool.admit(system + [1, 2])
    assert first is not None and first.cached == 0 and pool.misses == 3
    pool.name_full_blocks(first, system + [1, 2])
    second = pool.admit(system + [7, 8, 9])
    assert second is not None and second.cached == 12 and pool.hits == 3
    assert second.blocks[:3] == first.blocks[:3] and second.blocks[3] != first.blocks[3]
    used = pool.used
    pool.release(first)
    assert pool.used == used - 1  # the shared blocks are still held by the second request
    pool.release(second)
    assert pool.used == 0 and pool.free == 16  # cached blocks no one holds count as free
    third = pool.admit(system + [5])  # after both ended: still cached
    assert third is not None and third.cached == 12


def test_the_last_prompt_token_is_always_computed() -> None:
    pool = BlockPool(num_blocks=8, block_size=4)
    t = pool.admit([1, 2, 3, 4, 5, 6, 7, 8])
    assert t is not None
    pool.name_full_blocks(t, [1, 2, 3, 4, 5, 6, 7, 8])
    again = pool.admit([1, 2, 3, 4, 5, 6, 7, 8])  # fully cached, yet its first token needs the last logits
    assert again is not None and again.cached == 4


def test_eviction_takes_the_least_recently_used_cached_block_and_forgets_its_name() -> None:
    pool = BlockPool(num_blocks=3, block_size=2)
    old = pool.admit([1, 2, 0])
    assert old is not None
    pool.name_full_blocks(old, [1, 2, 0])
    pool.release(old)
    new = pool.admit([3, 4, 0])
    assert new is not None
    pool.name_full_blocks(new, [3, 4, 0])
    pool.release(new)
    assert pool.free == 3
    big = pool.admit([5] * 5)  # three blocks: the free one, then the LRU's oldest, then the other
    assert big is not None and pool.free == 0
    pool.release(big)
    fresh = pool.admit([1, 2, 0])
    assert fresh is not None and fresh.cached == 0  # its cached block was overwritten: a miss, not stale KV


def test_without_prefix_caching_nothing_is_shared() -> None:
    pool = BlockPool(num_blocks=8, block_size=4, prefix_caching=False)
    a = pool.admit(list(range(9)))
    assert a is not None
    pool.name_full_blocks(a, list(range(9)))
    b = pool.admit(list(range(9)))
    assert b is not None and b.cached == 0 and not set(a.blocks) & set(b.blocks)
