"""The C++ CPU paged-attention kernel (``gridserve.kernels.cpu_ops``) against the torch reference.

Blocks are scattered over a larger cache (non-contiguous, in random order), contexts cover 1, one
short of a block, a block multiple, one past it and several hundred tokens, with MHA, GQA and MQA
head layouts and batches that mix decode rows with prefill and chunked-prefill rows.
"""

from __future__ import annotations

import pytest
import torch

from gridserve.kernels import cpu_ops, dispatch, reference
from gridserve.kernels.attention_backend import (
    CPU,
    REFERENCE,
    AttentionMetadata,
    select_attention_backend,
)
from tests.missing_tool import missing

BUILD_SKIP = "the C++ CPU extension cannot be built here (see the logged reason): {}"

DECODE_CONTEXTS = [1, 15, 16, 17, 300, 333, 64, 2]


@pytest.fixture(scope="module")
def ops():
    built = cpu_ops.load()
    if built is None:
        reason = BUILD_SKIP.format("cpu_ops.load() returned None")
        print(reason)
        missing(reason)
    return built


def paged_batch(contexts, q_lens, heads, kv_heads, head_size, block_size=16, dtype=torch.float32):
    """Query, cache and metadata for sequences whose blocks are scattered over a larger cache."""
    gen = torch.Generator().manual_seed(sum(contexts) * 31 + heads * 7 + head_size + block_size)
    blocks = [(c + block_size - 1) // block_size for c in contexts]
    num_blocks = sum(blocks) + 7  # spare blocks (and block 0, the null block) hold noise
    scattered = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    block_table = torch.zeros(len(contexts), max(blocks) + 2, dtype=torch.int32)  # padded with 0
    for seq, n in enumerate(blocks):
        block_table[seq, :n] = torch.tensor(scattered[:n])
        scattered = scattered[n:]
    kv_cache = torch.randn(2, num_blocks, block_size, kv_heads, head_size, generator=gen).to(dtype)
    query_start_loc = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    query = torch.randn(sum(q_lens), heads, head_size, generator=gen).to(dtype)
    return query, kv_cache, query_start_loc, torch.tensor(contexts, dtype=torch.int32), block_table


def assert_close(actual, expected, tol=1e-5):
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


@pytest.mark.parametrize(
    ("heads", "kv_heads"), [(12, 12), (8, 2), (4, 1)], ids=["mha", "gqa", "mqa"]
)
@pytest.mark.parametrize("head_size", [64, 128, 72])
def test_decode_rows_match_reference(ops, heads, kv_heads, head_size):
    batch = paged_batch(DECODE_CONTEXTS, [1] * len(DECODE_CONTEXTS), heads, kv_heads, head_size)
    scale = head_size**-0.5
    assert_close(cpu_ops.paged_attention(*batch, scale, 1), reference.paged_attention(*batch, scale))


@pytest.mark.parametrize("head_size", [8, 40, 256])
@pytest.mark.parametrize("block_size", [1, 5, 32])
def test_any_head_size_and_block_size(ops, head_size, block_size):
    batch = paged_batch([1, 17, 64, 129], [1] * 4, 6, 3, head_size, block_size)
    scale = head_size**-0.5
    assert_close(cpu_ops.paged_attention(*batch, scale, 1), reference.paged_attention(*batch, scale))


# fresh prefills, chunked prefills onto cached prefixes, short multi-token rows, decodes
MIXED_CONTEXTS = [17, 1, 37, 300, 16, 40, 320, 15, 3]
MIXED_Q_LENS = [17, 1, 5, 1, 1, 3, 20, 15, 2]


@pytest.mark.parametrize(("heads", "kv_heads"), [(6, 6), (6, 2)], ids=["mha", "gqa"])
def test_decode_mixed_with_prefill_rows_in_one_call(ops, heads, kv_heads):
    batch = paged_batch(MIXED_CONTEXTS, MIXED_Q_LENS, heads, kv_heads, 64)
    expected = reference.paged_attention(*batch, 0.125)
    assert_close(cpu_ops.paged_attention(*batch, 0.125, max(MIXED_Q_LENS)), expected)
    assert_close(cpu_ops.paged_attention(*batch, 0.125), expected)  # max_query_len unknown


def test_kernel_alone_is_causal_for_multi_token_rows(ops):
    query, kv_cache, qsl, lens, table = paged_batch(MIXED_CONTEXTS, MIXED_Q_LENS, 4, 2, 32)
    out = torch.full_like(query, float("nan"))
    ops.paged_attention(out, query, kv_cache, qsl, lens, table, 0.2, 1 << 20)  # every row in C++
    assert_close(out, reference.paged_attention(query, kv_cache, qsl, lens, table, 0.2))


def test_kernel_leaves_rows_longer_than_its_limit_untouched(ops):
    query, kv_cache, qsl, lens, table = paged_batch([17, 40], [17, 1], 2, 2, 16)
    out = torch.zeros_like(query)
    ops.paged_attention(out, query, kv_cache, qsl, lens, table, 0.25, 1)
    assert out[:17].abs().sum() == 0
    assert out[17:].abs().sum() > 0


def test_query_may_be_a_strided_view(ops):
    query, kv_cache, qsl, lens, table = paged_batch(DECODE_CONTEXTS, [1] * 8, 4, 2, 64)
    qkv = torch.cat([query.flatten(1), torch.randn(8, 2 * 2 * 64)], dim=1)  # a merged projection
    view = qkv[:, : 4 * 64].view(8, 4, 64)
    assert not view.is_contiguous()
    assert_close(
        cpu_ops.paged_attention(view, kv_cache, qsl, lens, table, 0.125, 1),
        reference.paged_attention(query, kv_cache, qsl, lens, table, 0.125),
    )


def test_cache_may_be_a_strided_view(ops):
    query, kv_cache, qsl, lens, table = paged_batch(DECODE_CONTEXTS, [1] * 8, 4, 2, 64)
    wider = torch.randn(2, kv_cache.shape[1], 16, 3, 80)  # more heads and a wider head dim
    wider[..., :2, :64] = kv_cache
    view = wider[..., :2, :64]
    assert not view.is_contiguous()
    assert_close(
        cpu_ops.paged_attention(query, view, qsl, lens, table, 0.125, 1),
        reference.paged_attention(query, kv_cache, qsl, lens, table, 0.125),
    )


@pytest.mark.parametrize(("dtype", "tol"), [(torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_half_precision_inputs_accumulate_in_float32(ops, dtype, tol):
    batch = paged_batch(MIXED_CONTEXTS, MIXED_Q_LENS, 4, 2, 64, dtype=dtype)
    out = cpu_ops.paged_attention(*batch, 0.125)
    assert out.dtype == dtype
    upcast = [t.float() if t.is_floating_point() else t for t in batch]
    assert_close(out.float(), reference.paged_attention(*upcast, 0.125), tol)


@pytest.mark.parametrize("contexts", [DECODE_CONTEXTS, [333]], ids=["batch", "one-sequence"])
def test_result_does_not_depend_on_the_thread_count(ops, contexts):
    # one sequence: with more threads than tokens its KV heads are split across threads
    batch = paged_batch(contexts, [1] * len(contexts), 8, 4, 64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = cpu_ops.paged_attention(*batch, 0.125, 1)
        torch.set_num_threads(3)
        several = cpu_ops.paged_attention(*batch, 0.125, 1)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(several, single)
    assert_close(single, reference.paged_attention(*batch, 0.125))


@pytest.mark.parametrize(
    ("cache_dtype", "tol"),
    [(torch.float32, 1e-6), (torch.bfloat16, 1e-6), (torch.float16, 1e-6), (torch.float8_e4m3fn, 0)],
)
@pytest.mark.parametrize(("heads", "kv_heads", "head_size", "block_size"),
                         [(12, 12, 64, 16), (8, 2, 128, 32), (4, 1, 64, 48), (6, 3, 72, 16)])
def test_the_simd_path_and_the_portable_loops_agree(ops, cache_dtype, tol, heads, kv_heads, head_size,
                                                    block_size):
    """The AVX-512 path (fp32 / 16-bit caches, head and block sizes multiples of 16) against the
    portable loops it replaces, on every context tail of a 16-position chunk; fp8 caches and a head
    size of 72 always take the portable loops, so there the two runs are bitwise equal."""
    contexts = [1, 15, 16, 17, 31, 33, 64, 300, 301]
    query, kv_cache, qsl, lens, table = paged_batch(contexts, [1] * 7 + [3, 5], heads, kv_heads,
                                                    head_size, block_size)
    kv_cache = kv_cache.to(cache_dtype)
    previous = ops.paged_attention_isa(-1)
    try:
        portable = torch.full_like(query, float("nan"))
        assert ops.paged_attention_isa(0) == 0
        ops.paged_attention(portable, query, kv_cache, qsl, lens, table, 0.125, 8)
        fast = torch.full_like(query, float("nan"))
        ops.paged_attention_isa(1)
        ops.paged_attention(fast, query, kv_cache, qsl, lens, table, 0.125, 8)
        simd = ops.paged_attention_isa(1) == 1  # this CPU has AVX-512
    finally:
        ops.paged_attention_isa(previous)
    assert not portable.isnan().any()
    torch.testing.assert_close(fast, portable, atol=tol, rtol=tol)
    portable_only = tol == 0 or head_size % 16 or block_size % 16
    assert torch.equal(fast, portable) == bool(portable_only or not simd)  # the other path did run


def test_bad_metadata_raises_instead_of_reading_out_of_bounds(ops):
    query, kv_cache, qsl, lens, table = paged_batch([17], [1], 2, 2, 16)
    too_long = torch.tensor([table.shape[1] * 16 + 1], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="seq_lens"):
        cpu_ops.paged_attention(query, kv_cache, qsl, too_long, table, 0.25, 1)
    table[0, 0] = kv_cache.shape[1]
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_ops.paged_attention(query, kv_cache, qsl, lens, table, 0.25, 1)


# --- dispatch ----------------------------------------------------------------------------------


def test_auto_uses_the_cpp_kernel_for_cpu_attention_only(ops, monkeypatch):
    monkeypatch.delenv("GRIDSERVE_KERNELS", raising=False)
    assert select_attention_backend(torch.ones(1)) is CPU
    monkeypatch.setenv("GRIDSERVE_KERNELS", "reference")
    assert select_attention_backend(torch.ones(1)) is REFERENCE
    monkeypatch.setenv("GRIDSERVE_KERNELS", "cpu")
    monkeypatch.setattr(cpu_ops, "load_layer_ops", lambda: object())  # the KV write's library built too
    assert select_attention_backend(torch.ones(1)) is CPU
    # the layer ops without their library: the reference (with it: test_cpu_layer_ops)
    monkeypatch.setenv("GRIDSERVE_KERNELS", "auto")
    monkeypatch.setattr(cpu_ops, "load_layer_ops", lambda: None)
    assert dispatch._impl("rms_norm", torch.ones(1)) is reference.rms_norm


def test_a_failed_build_falls_back_under_auto_and_raises_under_cpu(monkeypatch):
    monkeypatch.setattr(cpu_ops, "load", lambda: None)
    monkeypatch.setattr(cpu_ops, "load_layer_ops", lambda: None)
    monkeypatch.setenv("GRIDSERVE_KERNELS", "auto")
    # the C++ backend, whose every call then runs the reference
    assert select_attention_backend(torch.ones(1)) is CPU
    query, kv_cache, qsl, lens, table = paged_batch([1, 9], [5, 20], 8, 2, 16)
    meta = AttentionMetadata(qsl, lens, table, torch.zeros(0, dtype=torch.int64), 9)
    assert torch.equal(CPU.attend(query, kv_cache, meta, 0.25), REFERENCE.attend(query, kv_cache, meta, 0.25))
    assert dispatch._impl("silu_and_mul", torch.ones(2)) is reference.silu_and_mul
    monkeypatch.setenv("GRIDSERVE_KERNELS", "cpu")
    with pytest.raises(RuntimeError, match="did not build"):
        select_attention_backend(torch.ones(1))
    with pytest.raises(RuntimeError, match="did not build"):
        dispatch._impl("silu_and_mul", torch.ones(2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_rows_gives_each_token_the_same_bits_in_prefill_chunks_and_decode(ops, dtype):
    """Batch-invariant mode: a 40-token prefill, the same sequence as 7 + 33 chunks, and its last
    token as a decode row next to other rows: bitwise the same per token, and close to SDPA."""
    query, kv_cache, _, _, block_table = paged_batch([40], [40], 8, 2, 64, dtype=dtype)
    scale = 64**-0.5

    def attend(first: int, count: int, table=block_table, q=None, qsl=None, lens=None):
        q = query[first : first + count] if q is None else q
        qsl = torch.tensor([0, count], dtype=torch.int32) if qsl is None else qsl
        lens = torch.tensor([first + count], dtype=torch.int32) if lens is None else lens
        meta = AttentionMetadata(qsl, lens, table, torch.zeros(0, dtype=torch.int64), int(q.shape[0]))
        return select_attention_backend(q, batch_invariant=True).attend(q, kv_cache, meta, scale)

    whole = attend(0, 40)
    torch.testing.assert_close(whole.float(), reference.paged_attention(
        query, kv_cache, torch.tensor([0, 40], dtype=torch.int32), torch.tensor([40], dtype=torch.int32),
        block_table, scale).float(), atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2)
    assert torch.equal(torch.cat([attend(0, 7), attend(7, 33)]), whole)
    # the last token as a decode row between two other sequences' rows (same cache, other tables)
    table = torch.cat([block_table, block_table, block_table])
    q = torch.cat([query[:3], query[39:40], query[10:12]])
    out = attend(0, 0, table, q, torch.tensor([0, 3, 4, 6], dtype=torch.int32),
                 torch.tensor([3, 40, 12], dtype=torch.int32))
    assert torch.equal(out[3], whole[39])
    assert torch.equal(out[:3], whole[:3])
