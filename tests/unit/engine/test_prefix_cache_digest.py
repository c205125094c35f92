"""The engine's prefix-cache digest: the KV-cache manager's blocks as the keys it publishes, and the
gateway's hashes of a prompt equal to the engine's (salt, LoRA adapter and images included)."""

from __future__ import annotations

import struct

from gridserve.services.engine.kv_cache_manager import KVCacheManager
from gridserve.services.engine.request import Request
from gridserve.shared.lora import LoRARequest
from gridserve.shared.multimodal import ImageFeature
from gridserve.shared.prefix_digest import PrefixDigest
from gridserve.shared.prefix_hash import digest_key, prompt_block_hashes
from gridserve.shared.sampling_params import SamplingParams

BS = 4


def _request(rid: str, tokens: list[int], **kwargs) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8), **kwargs)


def _schedule(mgr: KVCacheManager, req: Request) -> bool:
    hits, num_hit = mgr.get_computed_blocks(req)
    if mgr.allocate_slots(req, req.num_tokens - num_hit, hits, num_hit) is None:
        return False
    req.num_computed_tokens = req.num_tokens
    return True


def _watched(num_blocks: int) -> tuple[KVCacheManager, PrefixDigest]:
    mgr = KVCacheManager(num_blocks=num_blocks, block_size=BS)
    digest = PrefixDigest(BS, mgr.num_total_blocks)
    mgr.watch_prefix_cache(digest)
    return mgr, digest


def _cached_keys(mgr: KVCacheManager) -> set[int]:
    return {digest_key(key) for key in mgr.block_pool.cached_block_hash_to_block if isinstance(key, bytes)}


def test_only_full_cached_blocks_are_published():
    mgr, digest = _watched(num_blocks=20)
    req = _request("a", list(range(10)))  # two full blocks and a partial one
    assert _schedule(mgr, req)
    digest.commit()
    assert digest.keys == {digest_key(h) for h in req.block_hashes} == _cached_keys(mgr)
    assert len(digest.keys) == 2
    mgr.free(req)  # freed blocks keep their hashes: still cached, still published
    assert not digest.commit() and len(digest.keys) == 2


def test_evicted_blocks_leave_the_digest_and_shared_blocks_count_once():
    mgr, digest = _watched(num_blocks=7)  # 6 usable blocks
    a, b = _request("a", list(range(8))), _request("b", list(range(8)) + [99])
    assert _schedule(mgr, a) and _schedule(mgr, b)  # b hits a's two blocks
    digest.commit()
    assert len(digest.keys) == 2
    mgr.free(a)
    mgr.free(b)
    c = _request("c", list(range(100, 124)))  # six blocks: every free block, the cached ones too
    assert _schedule(mgr, c)
    digest.commit()
    assert digest.keys == _cached_keys(mgr) == {digest_key(h) for h in c.block_hashes[:6]}
    assert not digest.keys & {digest_key(h) for h in a.block_hashes}


def test_a_prefix_cache_reset_clears_the_digest():
    mgr, digest = _watched(num_blocks=20)
    req = _request("a", list(range(8)))
    assert _schedule(mgr, req)
    digest.commit()
    cursor = digest.cursor
    mgr.free(req)
    assert mgr.reset_prefix_cache()  # what sleep and worker recovery do too
    digest.commit()
    assert digest.keys == set()
    update = digest.since(cursor)
    assert update.reset and update.stored == ()


def test_the_gateways_hashes_equal_the_engines_with_salt_and_lora_adapter():
    tokens = list(range(50, 63))
    lora = LoRARequest("sql", 3, "/adapters/sql")
    req = _request("a", tokens, cache_salt="tenant-1", lora_request=lora)
    mgr, digest = _watched(num_blocks=20)
    assert _schedule(mgr, req)
    digest.commit()
    gateway = prompt_block_hashes(tokens, BS, cache_salt="tenant-1", lora_key=("sql", 3))
    assert gateway == req.block_hashes and len(gateway) == 3
    assert {digest_key(h) for h in gateway} == digest.keys
    # Each key matters: another salt, another adapter (or its id), no adapter: other hashes.
    for other in (prompt_block_hashes(tokens, BS, cache_salt="tenant-2", lora_key=("sql", 3)),
                  prompt_block_hashes(tokens, BS, cache_salt="tenant-1", lora_key=("sql", 4)),
                  prompt_block_hashes(tokens, BS, cache_salt="tenant-1")):
        assert not {digest_key(h) for h in other} & digest.keys


def test_the_gateways_hashes_equal_the_engines_with_images():
    image = ImageFeature(struct.pack("<4f", 1.0, 0.0, 0.0, 0.0), (1, 2, 2), offset=2, length=5)
    tokens = [7, 8] + [0] * 5 + [9, 10, 11, 12, 13]
    req = _request("a", tokens, mm_features=[image])
    mgr = KVCacheManager(num_blocks=20, block_size=BS)
    assert _schedule(mgr, req)
    assert prompt_block_hashes(tokens, BS, images=[image]) == req.block_hashes
    assert prompt_block_hashes(tokens, BS) != req.block_hashes  # the image keys its blocks
