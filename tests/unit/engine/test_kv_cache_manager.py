"""KVCacheManager: allocation, prefix-cache hits, LRU eviction, freeing, stats and sizing."""

from __future__ import annotations

import struct

import pytest

from gridserve.services.engine.kv_cache_manager import KVCacheManager, num_blocks_for_memory
from gridserve.services.engine.request import Request
from gridserve.shared.errors import ConfigError
from gridserve.shared.multimodal import ImageFeature
from gridserve.shared.prefix_hash import hash_block_tokens
from gridserve.shared.sampling_params import SamplingParams

BS = 4


def make_request(rid: str, tokens: list[int], cache_salt: str | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8), cache_salt=cache_salt)


def schedule(mgr: KVCacheManager, req: Request) -> list[int] | None:
    """Schedule a waiting request's whole prompt, as the scheduler does; returns all its block ids."""
    hits, num_hit = mgr.get_computed_blocks(req)
    new = mgr.allocate_slots(req, req.num_tokens - num_hit, hits, num_hit)
    if new is None:
        return None
    req.num_computed_tokens = req.num_tokens
    return mgr.get_block_ids(req.request_id)[0]  # the only KV cache group's


def decode_one(mgr: KVCacheManager, req: Request, token: int) -> list[int] | None:
    req.append_output_token_ids(token)
    new = mgr.allocate_slots(req, 1)
    if new is None:
        return None
    req.num_computed_tokens += 1
    return new[0]


# ---- hashing ---------------------------------------------------------------------------------


def test_block_hash_is_deterministic_and_depends_on_every_input():
    h = hash_block_tokens(None, [1, 2, 3, 4], None)
    assert h == hash_block_tokens(None, [1, 2, 3, 4], None)
    assert isinstance(h, bytes) and len(h) == 32
    assert h != hash_block_tokens(None, [1, 2, 3, 5], None)
    assert h != hash_block_tokens(b"parent", [1, 2, 3, 4], None)
    assert h != hash_block_tokens(None, [1, 2, 3, 4], ("salt",))


def test_block_hash_has_a_fixed_value_across_processes():
    # sha256 over: u32 0 (no parent) | u32 2 + two little-endian int64 | u32 0 (no extra keys)
    import hashlib
    import struct

    raw = (0).to_bytes(4, "little") + (2).to_bytes(4, "little") + struct.pack("<2q", 7, 8)
    raw += (0).to_bytes(4, "little")
    assert hash_block_tokens(None, [7, 8], None) == hashlib.sha256(raw).digest()


def test_request_block_hashes_cover_only_full_blocks_and_grow_with_output():
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    req = make_request("a", list(range(7)))
    schedule(mgr, req)
    assert len(req.block_hashes) == 1
    decode_one(mgr, req, 100)
    assert len(req.block_hashes) == 2
    assert req.block_hashes[1] == hash_block_tokens(req.block_hashes[0], [4, 5, 6, 100], None)


# ---- allocation ------------------------------------------------------------------------------


def test_allocate_returns_enough_new_blocks_and_never_the_null_block():
    mgr = KVCacheManager(num_blocks=10, block_size=BS, enable_caching=False)
    req = make_request("a", list(range(9)))
    (new,) = mgr.allocate_slots(req, 9)
    assert len(new) == 3 and 0 not in new
    assert mgr.get_block_ids("a") == (new,)
    req.num_computed_tokens = 9
    assert mgr.allocate_slots(req, 3) == ([],)  # still fits in block 3
    assert len(mgr.allocate_slots(req, 4)[0]) == 1  # 9 + 4 = 13 tokens -> 4 blocks


def test_allocate_out_of_blocks_returns_none_and_changes_nothing():
    mgr = KVCacheManager(num_blocks=4, block_size=BS)  # 3 usable
    a = make_request("a", list(range(8)))
    schedule(mgr, a)
    mgr.free(a)  # a's 2 blocks are free but still cached
    b = make_request("b", [50, 51, 52, 53])
    assert mgr.allocate_slots(b, 4) is not None
    # c hits a's two blocks (free, ref 0): touching them leaves no free block for c's third.
    c = make_request("c", list(range(8)) + [9, 9, 9, 9])
    hits, num_hit = mgr.get_computed_blocks(c)
    assert num_hit == 8
    free_before = mgr.num_free_blocks
    ref_before = [blk.ref_cnt for blk in hits[0]]
    assert mgr.allocate_slots(c, c.num_tokens - num_hit, hits, num_hit) is None
    assert mgr.num_free_blocks == free_before
    assert [blk.ref_cnt for blk in hits[0]] == ref_before
    assert mgr.get_block_ids("c") == ([],)
    assert "c" not in mgr.req_to_blocks


def test_prefix_hits_for_a_request_holding_blocks_are_rejected():
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    schedule(mgr, make_request("a", list(range(9))))
    b = make_request("b", list(range(9)))
    hits, n = mgr.get_computed_blocks(b)
    mgr.allocate_slots(b, 1, hits, n)
    with pytest.raises(ValueError):
        mgr.allocate_slots(b, 1, hits, n)


# ---- prefix caching --------------------------------------------------------------------------


def test_requests_sharing_a_three_block_prefix_share_physical_blocks():
    mgr = KVCacheManager(num_blocks=20, block_size=BS)
    prefix = list(range(12))
    a = make_request("a", prefix + [100, 101])
    b = make_request("b", prefix + [200])
    ids_a = schedule(mgr, a)
    hits, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 12 and [blk.block_id for blk in hits[0]] == ids_a[:3]
    new_b = mgr.allocate_slots(b, b.num_tokens - num_hit, hits, num_hit)
    (ids_b,) = mgr.get_block_ids("b")
    assert ids_b[:3] == ids_a[:3]
    assert new_b == (ids_b[3:],) and ids_b[3] != ids_a[3]
    assert [mgr.block_pool.blocks[i].ref_cnt for i in ids_a[:3]] == [2, 2, 2]
    mgr.free(a)
    assert [mgr.block_pool.blocks[i].ref_cnt for i in ids_a[:3]] == [1, 1, 1]
    mgr.free(b)
    assert [mgr.block_pool.blocks[i].ref_cnt for i in ids_a[:3]] == [0, 0, 0]


def test_different_cache_salt_gives_no_hit():
    mgr = KVCacheManager(num_blocks=20, block_size=BS)
    schedule(mgr, make_request("a", list(range(12)), cache_salt="alice"))
    assert mgr.get_computed_blocks(make_request("b", list(range(12)), cache_salt="bob"))[1] == 0
    assert mgr.get_computed_blocks(make_request("c", list(range(12))))[1] == 0
    assert mgr.get_computed_blocks(make_request("d", list(range(12)), cache_salt="alice"))[1] == 8


def _image(value: float, offset: int, length: int) -> ImageFeature:
    return ImageFeature(struct.pack("<4f", value, 0.0, 0.0, 0.0), (1, 2, 2), offset, length)


def test_blocks_covering_an_image_are_keyed_by_its_content():
    # Tokens 0-1 text, 2-9 one image (placeholder id 99), 10-13 text: blocks 0, 1, 2 cover the image.
    tokens = [5, 6] + [99] * 8 + [7, 8, 9, 10, 11]
    mgr = KVCacheManager(num_blocks=40, block_size=BS)
    first = Request("a", tokens, SamplingParams(max_tokens=8), mm_features=[_image(1.0, 2, 8)])
    schedule(mgr, first)
    same = Request("b", tokens, SamplingParams(max_tokens=8), mm_features=[_image(1.0, 2, 8)])
    assert mgr.get_computed_blocks(same)[1] == 12  # every full block, the image's included
    other = Request("c", tokens, SamplingParams(max_tokens=8), mm_features=[_image(2.0, 2, 8)])
    assert mgr.get_computed_blocks(other)[1] == 0  # block 0 holds image tokens 2-3 already
    assert other.block_hashes[0] != first.block_hashes[0]
    text = Request("d", tokens, SamplingParams(max_tokens=8))  # the same token ids, no image
    assert mgr.get_computed_blocks(text)[1] == 0


def test_an_image_after_a_text_prefix_shares_only_the_text_blocks():
    tokens = list(range(8)) + [99] * 8 + [1, 2, 3]
    mgr = KVCacheManager(num_blocks=40, block_size=BS)
    schedule(mgr, Request("a", tokens, SamplingParams(max_tokens=8), mm_features=[_image(1.0, 8, 8)]))
    other = Request("b", tokens, SamplingParams(max_tokens=8), mm_features=[_image(3.0, 8, 8)])
    assert mgr.get_computed_blocks(other)[1] == 8


def test_whole_prompt_cached_still_leaves_one_token_to_compute():
    mgr = KVCacheManager(num_blocks=20, block_size=BS)
    schedule(mgr, make_request("a", list(range(12))))
    b = make_request("b", list(range(12)))
    hits, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 8 and len(hits[0]) == 2  # the last full block is dropped
    assert num_hit < b.num_tokens
    c = make_request("c", list(range(13)))  # one token past the cached blocks: all 3 hit
    assert mgr.get_computed_blocks(c)[1] == 12


def test_only_blocks_computed_by_this_step_are_cached_with_chunked_prefill():
    mgr = KVCacheManager(num_blocks=20, block_size=BS)
    a = make_request("a", list(range(12)))
    mgr.allocate_slots(a, 6)  # first chunk: tokens 0..5 -> only block 0 is full
    a.num_computed_tokens = 6
    probe = make_request("p", list(range(12)) + [1])
    assert mgr.get_computed_blocks(probe)[1] == 4
    mgr.allocate_slots(a, 6)
    a.num_computed_tokens = 12
    assert mgr.get_computed_blocks(probe)[1] == 12


def test_decoded_tokens_become_cacheable_once_their_block_is_full():
    mgr = KVCacheManager(num_blocks=20, block_size=BS)
    a = make_request("a", [1, 2, 3])
    schedule(mgr, a)
    decode_one(mgr, a, 4)
    probe = make_request("p", [1, 2, 3, 4, 5])
    assert mgr.get_computed_blocks(probe)[1] == 4


def test_freed_blocks_hit_until_evicted_then_miss():
    mgr = KVCacheManager(num_blocks=4, block_size=BS)  # 3 usable
    a = make_request("a", list(range(8)))
    schedule(mgr, a)
    mgr.free(a)
    assert mgr.get_computed_blocks(make_request("b", list(range(9))))[1] == 8
    filler = make_request("f", [90] * 12)  # needs all 3 blocks: evicts a's
    assert mgr.allocate_slots(filler, 12) is not None
    mgr.free(filler)
    assert mgr.get_computed_blocks(make_request("c", list(range(9))))[1] == 0


def test_lru_evicts_earlier_freed_requests_first_and_tails_before_heads():
    mgr = KVCacheManager(num_blocks=7, block_size=BS)  # 6 usable
    a = make_request("a", list(range(0, 12)))
    b = make_request("b", list(range(100, 112)))
    ids_a, ids_b = schedule(mgr, a), schedule(mgr, b)
    mgr.free(a)
    mgr.free(b)
    order = [blk.block_id for blk in mgr.block_pool.free_block_queue.get_all_free_blocks()]
    assert order == ids_a[::-1] + ids_b[::-1]
    # Taking one block evicts a's tail block: a's first two blocks still hit, b fully hits.
    assert mgr.allocate_slots(make_request("x", [7]), 1) == ([ids_a[2]],)
    assert mgr.get_computed_blocks(make_request("a2", list(range(0, 13))))[1] == 8
    assert mgr.get_computed_blocks(make_request("b2", list(range(100, 113))))[1] == 12


# ---- freeing, reset, stats -------------------------------------------------------------------


def test_free_is_idempotent_and_unknown_requests_are_a_noop():
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request("a", list(range(10)))
    schedule(mgr, a)
    mgr.free(a)
    free_after = mgr.num_free_blocks
    mgr.free(a)
    mgr.free(make_request("never-seen", [1]))
    assert mgr.num_free_blocks == free_after == mgr.num_total_blocks
    assert mgr.get_block_ids("a") == ([],)


def test_no_blocks_leak_after_all_requests_are_freed():
    mgr = KVCacheManager(num_blocks=12, block_size=BS)
    prefix = list(range(8))
    reqs = [make_request(f"r{i}", prefix + [1000 + i] * (i + 1)) for i in range(4)]
    for r in reqs:
        assert schedule(mgr, r) is not None
    for step in range(5):
        for r in reqs:
            decode_one(mgr, r, step)
    assert mgr.num_free_blocks < mgr.num_total_blocks
    for r in reqs:
        mgr.free(r)
    assert mgr.num_free_blocks == mgr.num_total_blocks == 11
    assert mgr.usage == 0.0
    assert all(b.ref_cnt == 0 for b in mgr.block_pool.blocks)


def test_reset_prefix_cache_fails_while_in_use_and_succeeds_after():
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request("a", list(range(8)))
    schedule(mgr, a)
    assert mgr.reset_prefix_cache() is False
    mgr.free(a)
    assert mgr.get_computed_blocks(make_request("b", list(range(9))))[1] == 8
    assert mgr.reset_prefix_cache() is True
    assert mgr.get_computed_blocks(make_request("c", list(range(9))))[1] == 0


def test_hit_and_query_counters_count_tokens():
    mgr = KVCacheManager(num_blocks=20, block_size=BS)
    schedule(mgr, make_request("a", list(range(10))))  # 10 queried, 0 hit
    schedule(mgr, make_request("b", list(range(10))))  # 10 queried, 8 hit
    assert (mgr.prefix_cache_queries, mgr.prefix_cache_hits) == (20, 8)


def test_caching_disabled_never_hits():
    mgr = KVCacheManager(num_blocks=20, block_size=BS, enable_caching=False)
    schedule(mgr, make_request("a", list(range(12))))
    assert mgr.get_computed_blocks(make_request("b", list(range(13)))) == (([],), 0)
    assert mgr.prefix_cache_queries == 0


def test_usage_tracks_blocks_in_use():
    mgr = KVCacheManager(num_blocks=5, block_size=BS)
    a = make_request("a", list(range(8)))
    schedule(mgr, a)
    assert mgr.usage == pytest.approx(0.5)
    mgr.free(a)
    assert mgr.usage == 0.0


# ---- sizing ----------------------------------------------------------------------------------


def test_num_blocks_for_memory_divides_the_budget_into_whole_blocks():
    # 16 tokens * 1024 bytes = 16 KiB per block.
    assert num_blocks_for_memory(10 * 16 * 1024, bytes_per_token=1024, block_size=16) == 10
    assert num_blocks_for_memory(10 * 16 * 1024 + 16383, bytes_per_token=1024, block_size=16) == 10
    assert num_blocks_for_memory(2 * 16 * 1024, bytes_per_token=1024, block_size=16) == 2


def test_num_blocks_for_memory_below_two_blocks_is_a_config_error():
    with pytest.raises(ConfigError) as exc:
        num_blocks_for_memory(2 * 16 * 1024 - 1, bytes_per_token=1024, block_size=16)
    assert exc.value.field == "cache.kv_cache_memory_bytes"


def test_lookup_of_a_request_that_does_not_fit_is_not_counted():
    mgr = KVCacheManager(num_blocks=3, block_size=BS)  # 2 usable blocks
    schedule(mgr, make_request("a", list(range(2 * BS))))
    before = (mgr.prefix_cache_queries, mgr.prefix_cache_hits)
    waiting = make_request("b", list(range(100, 100 + BS)))
    for _ in range(3):  # the scheduler retries every step while it waits
        assert schedule(mgr, waiting) is None
    assert (mgr.prefix_cache_queries, mgr.prefix_cache_hits) == before
