"""BlockPool and FreeBlockQueue: null block, ref counts, LRU order, hash eviction, reset."""

from __future__ import annotations

import pytest

from gridserve.services.engine.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock


def ids(blocks):
    return [b.block_id for b in blocks]


def test_free_queue_popleft_append_and_remove_from_middle():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert len(q) == 5
    q.remove(blocks[2])
    assert ids(q.get_all_free_blocks()) == [0, 1, 3, 4]
    assert q.popleft() is blocks[0]
    q.append(blocks[0])
    assert ids(q.get_all_free_blocks()) == [1, 3, 4, 0]
    assert len(q) == 4
    assert not q.contains(blocks[2])


def test_free_queue_rejects_double_append_and_removing_absent_block():
    b = KVCacheBlock(1)
    q = FreeBlockQueue([b])
    with pytest.raises(ValueError):
        q.append(b)
    q.popleft()
    with pytest.raises(ValueError):
        q.remove(b)
    with pytest.raises(ValueError):
        q.popleft()


def test_null_block_is_never_handed_out():
    pool = BlockPool(num_blocks=4, enable_caching=True)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert pool.get_num_free_blocks() == 3
    got = pool.get_new_blocks(3)
    assert 0 not in ids(got)
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.free_blocks([pool.null_block])  # ignored: the null block is never freed
    assert pool.get_num_free_blocks() == 0


def test_get_new_blocks_raises_without_taking_anything_when_short():
    pool = BlockPool(num_blocks=3, enable_caching=True)
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)
    assert pool.get_num_free_blocks() == 2


def test_touch_increments_ref_count_and_free_decrements_it():
    pool = BlockPool(num_blocks=4, enable_caching=True)
    (b,) = pool.get_new_blocks(1)
    assert b.ref_cnt == 1
    pool.touch([b])
    assert b.ref_cnt == 2
    pool.free_blocks([b])
    assert b.ref_cnt == 1 and pool.get_num_free_blocks() == 2
    pool.free_blocks([b])
    assert b.ref_cnt == 0 and pool.get_num_free_blocks() == 3
    with pytest.raises(ValueError):
        pool.free_blocks([b])


def test_touch_takes_a_free_block_out_of_the_free_list():
    pool = BlockPool(num_blocks=4, enable_caching=True)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    assert pool.get_num_free_blocks() == 3
    pool.touch([b])
    assert b.ref_cnt == 1
    assert pool.get_num_free_blocks() == 2
    assert b not in pool.free_block_queue.get_all_free_blocks()


def test_blocks_freed_earlier_are_evicted_first():
    pool = BlockPool(num_blocks=5, enable_caching=True)
    a, b, c, d = pool.get_new_blocks(4)
    pool.free_blocks([c])
    pool.free_blocks([a])
    pool.free_blocks([d, b])
    assert ids(pool.get_new_blocks(4)) == [c.block_id, a.block_id, d.block_id, b.block_id]


def test_freed_block_keeps_its_hash_until_evicted():
    pool = BlockPool(num_blocks=3, enable_caching=True)
    b1, b2 = pool.get_new_blocks(2)
    pool.cache_full_blocks([b1, b2], [b"h1", b"h2"], num_cached_blocks=0, num_full_blocks=1)
    assert pool.get_cached_block(b"h1") is b1
    assert pool.get_cached_block(b"h2") is None  # not full yet
    pool.free_blocks([b1])
    assert pool.get_cached_block(b"h1") is b1  # still a hit after free
    (reused,) = pool.get_new_blocks(1)
    assert reused is b1
    assert reused.block_hash is None
    assert pool.get_cached_block(b"h1") is None  # evicted


def test_two_blocks_with_the_same_hash_both_stay_findable():
    pool = BlockPool(num_blocks=3, enable_caching=True)
    b1, b2 = pool.get_new_blocks(2)
    pool.cache_full_blocks([b1], [b"h"], 0, 1)
    pool.cache_full_blocks([b2], [b"h"], 0, 1)
    pool.free_blocks([b1, b2])
    pool.get_new_blocks(1)  # evicts b1
    assert pool.get_cached_block(b"h") is b2


def test_caching_disabled_records_no_hashes():
    pool = BlockPool(num_blocks=3, enable_caching=False)
    (b,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([b], [b"h"], 0, 1)
    assert b.block_hash is None
    assert pool.get_cached_block(b"h") is None


def test_reset_prefix_cache_fails_while_a_block_is_in_use_and_succeeds_after():
    pool = BlockPool(num_blocks=4, enable_caching=True)
    (b,) = pool.get_new_blocks(1)
    pool.cache_full_blocks([b], [b"h"], 0, 1)
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(b"h") is b
    pool.free_blocks([b])
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(b"h") is None
    assert b.block_hash is None


def test_usage_is_the_fraction_of_usable_blocks_in_use():
    pool = BlockPool(num_blocks=5, enable_caching=True)
    assert pool.usage == 0.0
    blocks = pool.get_new_blocks(2)
    assert pool.usage == pytest.approx(0.5)
    pool.get_new_blocks(2)
    assert pool.usage == pytest.approx(1.0)
    pool.free_blocks(blocks)
    assert pool.usage == pytest.approx(0.5)


def test_pool_needs_at_least_two_blocks():
    with pytest.raises(ValueError):
        BlockPool(num_blocks=1, enable_caching=True)
