"""KV cache groups (``shared/kv_cache_spec.py``, ``KVCacheManager`` with several groups): planning
from the workers' per-layer specs, window groups freeing what their window passed, prefix hits every
group agrees on, and no block leaked by preemption or freeing."""

from __future__ import annotations

import pytest

from gridserve.services.engine.kv_cache_manager import KVCacheManager
from gridserve.services.engine.request import Request
from gridserve.shared.errors import ConfigError
from gridserve.shared.kv_cache_spec import (
    FULL,
    MLA,
    NONE,
    SLIDING_WINDOW,
    KVCacheGroup,
    LayerKVCacheSpec,
    num_skipped_blocks,
    plan_kv_cache,
)
from gridserve.shared.sampling_params import SamplingParams

BS = 4
PER_TOKEN = 64  # bytes per token of one layer


def _layer(i: int, window: int = 0, per_token: int = PER_TOKEN, heads: int = 2) -> LayerKVCacheSpec:
    kind = SLIDING_WINDOW if window else FULL
    return LayerKVCacheSpec(f"model.layers.{i}.self_attn.attn", kind, BS, per_token, sliding_window=window,
                            num_kv_heads=heads, head_size=per_token // (4 * heads))


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8))


# ---- planning -------------------------------------------------------------------------------------

def test_a_model_of_one_kind_is_one_group_with_a_slot_per_layer():
    specs = [_layer(i) for i in range(4)]
    plan = plan_kv_cache([specs], available_bytes=100 * 4 * BS * PER_TOKEN, block_size=BS, max_model_len=32)
    assert [g.name for g in plan.groups] == ["full"] and len(plan.groups[0].layer_names) == 4
    assert plan.bytes_per_block == 4 * BS * PER_TOKEN and plan.num_blocks == 100


def test_alternating_window_and_full_layers_make_two_groups_that_share_slots():
    specs = [_layer(i, window=16 if i % 2 == 0 else 0) for i in range(6)]
    plan = plan_kv_cache([specs], available_bytes=100 * 3 * BS * PER_TOKEN, block_size=BS, max_model_len=32)
    assert [(g.name, len(g.layer_names)) for g in plan.groups] == [("sliding_window_16", 3), ("full", 3)]
    assert plan.windows == (16, 0)
    # layer i of each group is slot i: one block id costs three layers' pages, not six
    assert plan.bytes_per_block == 3 * BS * PER_TOKEN and plan.num_blocks == 100
    assert plan.slots["model.layers.0.self_attn.attn"] == (0, 0)
    assert plan.slots["model.layers.1.self_attn.attn"] == (1, 0)


def test_five_window_layers_per_full_one_split_into_groups_of_the_full_kind_s_size():
    specs = [_layer(i, window=0 if i % 6 == 5 else 8) for i in range(12)]  # Gemma 3's 5:1 pattern
    plan = plan_kv_cache([specs], available_bytes=1 << 20, block_size=BS, max_model_len=32)
    sizes = [(g.name, len(g.layer_names)) for g in plan.groups]
    assert sizes == [("sliding_window_8", 2)] * 5 + [("full", 2)]
    assert plan.bytes_per_block == 2 * BS * PER_TOKEN


def test_without_the_hybrid_allocator_windows_are_planned_full():
    specs = [_layer(i, window=16 if i % 2 == 0 else 0) for i in range(4)]
    plan = plan_kv_cache([specs], available_bytes=1 << 20, block_size=BS, max_model_len=32, hybrid=False)
    assert [g.name for g in plan.groups] == ["full"] and plan.bytes_per_block == 4 * BS * PER_TOKEN


def test_pipeline_stages_report_their_own_layers_and_the_pool_fits_the_largest_stage():
    stage0 = [_layer(0, window=16), _layer(1), _layer(2, window=16)]
    stage1 = [_layer(3)]
    plan = plan_kv_cache([stage0, stage1], available_bytes=1 << 20, block_size=BS, max_model_len=32)
    assert [len(g.layer_names) for g in plan.groups] == [2, 2]
    # stage 0 holds slots 0 and 1 (window layers 0 and 2 share them with full layers 1 and 3)
    assert plan.bytes_per_block == 2 * BS * PER_TOKEN


def test_tensor_parallel_ranks_report_the_same_layers_once():
    rank = [_layer(0), _layer(1)]
    plan = plan_kv_cache([rank, rank], available_bytes=1 << 20, block_size=BS, max_model_len=32)
    assert len(plan.groups[0].layer_names) == 2


def test_ranks_that_disagree_on_a_layer_s_kind_are_refused():
    with pytest.raises(ConfigError, match="disagree"):
        plan_kv_cache([[_layer(0)], [_layer(0, window=8)]], available_bytes=1 << 20, block_size=BS,
                      max_model_len=32)


def test_mixed_kinds_of_different_page_shapes_are_refused_by_name():
    specs = [_layer(0, window=8), _layer(1, per_token=128, heads=4)]
    with pytest.raises(ConfigError, match="page shape"):
        plan_kv_cache([specs], available_bytes=1 << 20, block_size=BS, max_model_len=32)


def test_layers_of_kind_none_are_left_out_and_a_model_with_no_kv_is_refused():
    specs = [_layer(0), LayerKVCacheSpec("x", NONE, BS, 0)]
    assert plan_kv_cache([specs], 1 << 20, BS, 32).groups[0].layer_names == ("model.layers.0.self_attn.attn",)
    with pytest.raises(ConfigError, match="no layer"):
        plan_kv_cache([[LayerKVCacheSpec("x", NONE, BS, 0)]], 1 << 20, BS, 32)


def test_a_cache_that_cannot_hold_one_longest_request_in_every_group_is_refused():
    specs = [_layer(0, window=8), _layer(1)]
    # 2 groups x ceil(32 / 4) = 16 blocks needed, 10 usable
    with pytest.raises(ConfigError, match="max_model_len=32 needs 16"):
        plan_kv_cache([specs], available_bytes=11 * BS * PER_TOKEN, block_size=BS, max_model_len=32)


def test_an_mla_spec_is_a_kind_of_its_own():
    mla = LayerKVCacheSpec("a", MLA, BS, 2 * (512 + 64), kv_lora_rank=512, qk_rope_head_dim=64)
    plan = plan_kv_cache([[mla]], 1 << 20, BS, 32)
    assert plan.groups[0].name == "mla" and plan.bytes_per_block == BS * 2 * 576


def test_a_spec_must_be_consistent():
    with pytest.raises(ValueError, match="positive window"):
        LayerKVCacheSpec("a", SLIDING_WINDOW, BS, 8)
    with pytest.raises(ValueError, match="unknown KV cache kind"):
        LayerKVCacheSpec("a", "linear", BS, 8)


def test_skipped_blocks_are_those_wholly_before_the_next_token_s_window():
    assert num_skipped_blocks(0, 100, 4) == 0
    assert num_skipped_blocks(8, 7, 4) == 0  # the next token (7) sees 0..7
    assert num_skipped_blocks(8, 12, 4) == 1  # sees 5..12: block 0 (0..3) is done
    assert num_skipped_blocks(8, 13, 4) == 1  # sees 6..13
    assert num_skipped_blocks(8, 15, 4) == 2  # sees 8..15


# ---- the manager with a window group --------------------------------------------------------------

WINDOW = 8
GROUPS = (KVCacheGroup(SLIDING_WINDOW, ("w",), WINDOW), KVCacheGroup(FULL, ("f",)))


def _manager(num_blocks: int = 64, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, caching, GROUPS)


def _admit(mgr: KVCacheManager, req: Request, chunk: int | None = None) -> int:
    hits, num_hit = mgr.get_computed_blocks(req)
    n = min(req.num_tokens - num_hit, chunk or req.num_tokens)
    assert mgr.allocate_slots(req, n, hits, num_hit) is not None
    req.num_computed_tokens = num_hit + n
    return num_hit


def _decode(mgr: KVCacheManager, req: Request, token: int = 5) -> None:
    req.append_output_token_ids(token)
    assert mgr.allocate_slots(req, 1) is not None
    req.num_computed_tokens += 1


def test_a_window_group_holds_the_window_plus_a_block_once_the_prompt_is_in():
    mgr = _manager()
    req = _request("a", list(range(40)))
    _admit(mgr, req)  # one chunk: every block of both groups for this step
    assert mgr.blocks_in_use == [10, 10]
    for step in range(12):
        _decode(mgr, req)
        window_ids, full_ids = mgr.get_block_ids("a")
        real = [b for b in window_ids if b != 0]
        assert len(real) <= -(-WINDOW // BS) + 1, (step, window_ids)
        assert 0 not in full_ids and len(full_ids) == -(-req.num_tokens // BS)
        # the real blocks start with the first one the window of the step's token (the last computed) reached
        assert window_ids.index(real[0]) == num_skipped_blocks(WINDOW, req.num_computed_tokens - 1, BS)
    assert mgr.blocks_in_use[0] <= 3 and mgr.blocks_in_use[1] == 13
    mgr.free(req)
    assert mgr.blocks_in_use == [0, 0] and mgr.num_free_blocks == mgr.num_total_blocks


def test_chunked_prefill_never_holds_more_window_blocks_than_the_chunk_and_its_window():
    mgr = _manager()
    req = _request("a", list(range(64)))
    _admit(mgr, req, chunk=8)
    while req.num_computed_tokens < req.num_tokens:
        assert mgr.allocate_slots(req, 8) is not None
        held = [b for b in mgr.get_block_ids("a")[0] if b != 0]
        assert len(held) <= (WINDOW + 8) // BS + 1
        req.num_computed_tokens += 8


def test_freed_window_blocks_keep_their_hashes_for_later_hits():
    mgr = _manager()
    a = _request("a", list(range(40)))
    _admit(mgr, a)
    _decode(mgr, a)  # frees the window group's head blocks, still hashed
    before = mgr.num_free_blocks
    b = _request("b", list(range(40)) + [99])
    assert _admit(mgr, b) == 40
    window_ids, full_ids = mgr.get_block_ids("b")
    # the hit takes only the window's blocks in the window group; the full group takes all ten
    skipped = num_skipped_blocks(WINDOW, 40, BS)
    assert window_ids[:skipped] == [0] * skipped and 0 not in window_ids[skipped:10]
    assert full_ids[:10] == mgr.get_block_ids("a")[1][:10]
    assert before - mgr.num_free_blocks <= 10 - skipped + 2  # re-touched window blocks + one new per group


def test_a_hit_needs_the_window_s_blocks_in_the_window_group():
    mgr = _manager()
    a = _request("a", list(range(40)))
    _admit(mgr, a)
    mgr.free(a)
    # evict the window group's block 8 (tokens 32..35) alone: take it out of the free list
    victim = mgr.block_pool.get_cached_block(a.block_hashes[8], 0)
    mgr.block_pool.free_block_queue.remove(victim)
    mgr.block_pool._evict(victim)
    mgr.block_pool.free_block_queue.append(victim)
    assert victim.block_hash is None
    # the full group still has all ten blocks; the window group misses block 8, so the longest hit
    # with the two blocks before its end cached (window 8 = 2 blocks of 4) ends at block 8
    b = _request("b", list(range(40)) + [1])
    hits, num_hit = mgr.get_computed_blocks(b)
    assert num_hit == 8 * BS
    assert [x.block_id for x in hits[0]][:6] == [0] * 6 and all(not x.is_null for x in hits[0][6:])
    assert len(hits[1]) == 8


def test_a_short_hit_from_the_sequence_start_needs_no_window_before_it():
    mgr = _manager()
    a = _request("a", list(range(8)) + [100, 101, 102, 103])
    _admit(mgr, a)
    b = _request("b", list(range(8)) + [7, 7, 7, 7, 7])
    assert _admit(mgr, b) == 8  # blocks 0 and 1: a run from block 0, no window needed before it


def test_preempting_and_freeing_with_mixed_groups_leaks_nothing():
    mgr = _manager(num_blocks=26)
    reqs = [_request(str(i), [i] * 30) for i in range(4)]
    running = []
    for r in reqs:
        hits, num_hit = mgr.get_computed_blocks(r)
        if mgr.allocate_slots(r, r.num_tokens - num_hit, hits, num_hit) is None:
            break
        r.num_computed_tokens = r.num_tokens
        running.append(r)
    assert 1 <= len(running) < 4  # the transient prefill does not let all four in
    for _ in range(20):
        for r in list(running):
            r.append_output_token_ids(3)
            while mgr.allocate_slots(r, 1) is None:
                victim = running.pop()
                mgr.free(victim)
                victim.num_computed_tokens = 0
                if victim is r:
                    break
            else:
                r.num_computed_tokens += 1
    for r in running:
        mgr.free(r)
    assert mgr.blocks_in_use == [0, 0] and mgr.num_free_blocks == mgr.num_total_blocks
    assert all(b.ref_cnt == 0 for b in mgr.block_pool.blocks[1:])


def test_the_same_tokens_cached_in_two_groups_are_two_entries():
    mgr = _manager()
    a = _request("a", list(range(9)))
    _admit(mgr, a)
    w, f = mgr.get_block_ids("a")
    assert mgr.block_pool.get_cached_block(a.block_hashes[0], 0).block_id == w[0]
    assert mgr.block_pool.get_cached_block(a.block_hashes[0], 1).block_id == f[0]
    assert w[0] != f[0]


def test_flat_prefix_hits_are_refused_when_there_are_several_groups():
    mgr = _manager()
    a = _request("a", list(range(9)))
    with pytest.raises(ValueError, match="per group"):
        mgr.allocate_slots(a, 9, [mgr.block_pool.blocks[1]], 4)


def test_a_new_block_of_one_group_is_never_a_free_hit_of_another():
    mgr = _manager(num_blocks=7)  # six usable blocks
    a = _request("a", list(range(8)))
    _admit(mgr, a)  # blocks 1, 2 (window group), 3, 4 (full group)
    z = _request("z", [50, 51, 52])
    _admit(mgr, z)  # 5, 6
    mgr.free(a)
    mgr.free(z)  # the free list is a's hits first, then 5 and 6
    b = _request("b", list(range(8)) + [9])
    assert _admit(mgr, b) == 8
    window_ids, full_ids = mgr.get_block_ids("b")
    assert not {i for i in window_ids if i} & set(full_ids), (window_ids, full_ids)
    assert all(mgr.block_pool.blocks[i].ref_cnt == 1 for i in full_ids + [i for i in window_ids if i])
    mgr.free(b)
    assert mgr.blocks_in_use == [0, 0] and mgr.num_free_blocks == mgr.num_total_blocks
