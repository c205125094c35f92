"""Each Triton kernel against its torch reference, run on CPU in the Triton interpreter.

Shapes are tiny (the interpreter is ~3000x slower than torch) but cover the edge cases: context
length 1, exactly a block multiple, one token past a block boundary, blocks scattered over the
cache, GQA / MQA, and batches mixing decode, prefill and chunked-prefill rows.
"""

from __future__ import annotations

import os
import sys

# Must precede the first `import triton` in this process: triton.language binds to it then.
_TRITON_IMPORTED_TOO_EARLY = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
os.environ["TRITON_INTERPRET"] = "1"

import importlib  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

import gridserve.kernels as kernels_package  # noqa: E402

pytest.importorskip("triton")
if _TRITON_IMPORTED_TOO_EARLY:
    pytest.skip(
        "triton was imported before TRITON_INTERPRET=1 was set (by an earlier test module); "
        "run tests/unit/kernels/test_triton_kernels.py in its own pytest process",
        allow_module_level=True,
    )

from gridserve.kernels import cpu_ops, dispatch, reference, select_attention_backend, triton_ops  # noqa: E402
from gridserve.kernels.triton_ops import attention  # noqa: E402
from gridserve.kernels.triton_ops.attention import AttentionPlan, run_paged_attention  # noqa: E402

pytestmark = pytest.mark.triton

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# The interpreter truncates float32 -> bfloat16 where the GPU rounds: allow a couple of ulps.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DECODE_CONTEXTS = [1, 16, 17, 48, 100, 33]  # 1, a block multiple, one past a boundary, long


def assert_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    tol = TOLERANCE[expected.dtype]
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


def paged_batch(
    contexts: list[int],
    q_lens: list[int],
    heads: int,
    kv_heads: int,
    head_size: int,
    page: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, ...]:
    """Query, cache and metadata for sequences whose blocks are scattered over a larger cache."""
    gen = torch.Generator().manual_seed(sum(contexts) + heads + page)
    pages = [(c + page - 1) // page for c in contexts]
    num_blocks = sum(pages) + 5  # spare blocks (and block 0, the null block) hold noise
    scattered = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    block_table = torch.zeros(len(contexts), max(pages) + 1, dtype=torch.int32)  # padded with 0
    for seq, n in enumerate(pages):
        block_table[seq, :n] = torch.tensor(scattered[:n])
        scattered = scattered[n:]
    kv_cache = torch.randn(2, num_blocks, page, kv_heads, head_size, generator=gen).to(dtype)
    query_start_loc = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    query = torch.randn(sum(q_lens), heads, head_size, generator=gen).to(dtype)
    seq_lens = torch.tensor(contexts, dtype=torch.int32)
    return query, kv_cache, query_start_loc, seq_lens, block_table


# --- paged attention ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_size", "page"),
    [(8, 2, 64, 16), (4, 1, 128, 16), (2, 2, 64, 32)],
    ids=["gqa-d64-b16", "mqa-d128-b16", "mha-d64-b32"],
)
def test_decode_matches_reference(dtype, heads, kv_heads, head_size, page):
    batch = paged_batch(DECODE_CONTEXTS, [1] * 6, heads, kv_heads, head_size, page, dtype)
    scale = head_size**-0.5
    out = triton_ops.paged_attention(*batch, scale, 1)
    assert_matches(out, reference.paged_attention(*batch, scale))


@pytest.mark.parametrize("dtype", DTYPES)
def test_split_k_decode_matches_reference(dtype):
    # 3 slices of 16-token tiles: long contexts use all three, short ones leave slices empty
    batch = paged_batch(DECODE_CONTEXTS, [1] * 6, 4, 2, 64, 16, dtype)
    out = run_paged_attention(*batch, 0.125, AttentionPlan(block_m=16, tile_n=16, num_splits=3))
    assert_matches(out, reference.paged_attention(*batch, 0.125))


# fresh prefill, chunked prefill onto a 32-token prefix, two decodes, a chunk past a boundary
MIXED_CONTEXTS = [17, 37, 16, 1, 40]
MIXED_Q_LENS = [17, 5, 1, 1, 8]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("head_size", "page"), [(64, 16), (128, 32)])
def test_prefill_and_chunked_prefill_match_reference(dtype, head_size, page):
    batch = paged_batch(MIXED_CONTEXTS, MIXED_Q_LENS, 6, 2, head_size, page, dtype)  # group of 3
    scale = head_size**-0.5
    out = triton_ops.paged_attention(*batch, scale)
    assert_matches(out, reference.paged_attention(*batch, scale))


@pytest.mark.parametrize(
    "plan",
    [AttentionPlan(16, 16), AttentionPlan(32, 64), AttentionPlan(16, 32, num_splits=3)],
    ids=["small-tiles", "large-tiles", "split-k"],
)
def test_any_plan_gives_the_reference_result(plan):
    batch = paged_batch(MIXED_CONTEXTS, MIXED_Q_LENS, 4, 2, 64, 16, torch.float32)
    assert_matches(run_paged_attention(*batch, 0.125, plan), reference.paged_attention(*batch, 0.125))


def test_long_decode_with_few_sequences_is_split(monkeypatch):
    monkeypatch.setattr(attention, "num_sms", lambda device: 16)
    batch = paged_batch([300, 7], [1, 1], 4, 2, 64, 16, torch.float16)
    plan = attention.plan_attention(batch[0], batch[1], batch[4], 2, None)
    assert plan.num_splits > 1
    assert_matches(triton_ops.paged_attention(*batch, 0.125), reference.paged_attention(*batch, 0.125))


def test_paged_attention_with_no_tokens_returns_empty():
    query, kv_cache, _, _, block_table = paged_batch([4], [1], 2, 2, 64, 16, torch.float32)
    empty = query[:0]
    out = triton_ops.paged_attention(
        empty, kv_cache, torch.zeros(1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
        block_table[:0], 0.125,
    )
    assert out.shape == empty.shape


# --- reshape_and_cache -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache_writes_the_reference_slots(dtype):
    gen = torch.Generator().manual_seed(0)
    key, value = torch.randn(2, 9, 2, 64, generator=gen).to(dtype)
    slots = torch.randperm(6 * 16, generator=gen)[:9]  # scattered over blocks and offsets
    expected = torch.zeros(2, 6, 16, 2, 64, dtype=dtype)
    actual = expected.clone()
    reference.reshape_and_cache(key, value, expected, slots)
    triton_ops.reshape_and_cache(key, value, actual, slots)
    assert torch.equal(actual, expected)


def test_reshape_and_cache_casts_to_the_cache_dtype_and_skips_padding_slots():
    key, value = torch.randn(2, 4, 1, 64)
    slots = torch.tensor([3, -1, 17, 40])
    expected = torch.zeros(2, 3, 16, 1, 64, dtype=torch.float16)
    actual = expected.clone()
    keep = slots >= 0
    reference.reshape_and_cache(key[keep], value[keep], expected, slots[keep])
    triton_ops.reshape_and_cache(key, value, actual, slots)
    assert torch.equal(actual, expected)


# --- norms, rotary embedding, activation -------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_reference(dtype):
    x = torch.randn(3, 5, 96).to(dtype)  # hidden size not a power of two
    weight = torch.randn(96).to(dtype)
    assert_matches(triton_ops.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6))


def test_rms_norm_with_float32_weight_promotes_like_reference():
    x, weight = torch.randn(4, 64).to(torch.bfloat16), torch.rand(64)
    out = triton_ops.rms_norm(x, weight, 1e-5)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, reference.rms_norm(x, weight, 1e-5), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_matches_reference(dtype):
    x, residual = torch.randn(2, 7, 80).to(dtype)
    weight = torch.randn(80).to(dtype)
    out, new_residual = triton_ops.fused_add_rms_norm(x, residual, weight, 1e-6)
    expected_out, expected_residual = reference.fused_add_rms_norm(x, residual, weight, 1e-6)
    assert_matches(new_residual, expected_residual)
    assert_matches(out, expected_out)


def llama_cos_sin_cache(rotary_dim: int, max_position: int = 64) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    freqs = torch.outer(torch.arange(max_position).float(), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("rotary_dim", [64, 32], ids=["full", "partial"])
def test_rotary_embedding_matches_reference(dtype, is_neox, rotary_dim):
    positions = torch.tensor([0, 5, 63, 17, 17, 2])
    query, key = torch.randn(6, 4, 64).to(dtype), torch.randn(6, 2, 64).to(dtype)
    cache = llama_cos_sin_cache(rotary_dim)
    q_out, k_out = triton_ops.rotary_embedding(positions, query, key, cache, is_neox)
    q_ref, k_ref = reference.rotary_embedding(positions, query, key, cache, is_neox)
    assert_matches(q_out, q_ref)
    assert_matches(k_out, k_ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_reference(dtype):
    x = torch.randn(3, 4, 2 * 40).to(dtype)
    assert_matches(triton_ops.silu_and_mul(x), reference.silu_and_mul(x))


# --- dispatch and fallback ---------------------------------------------------------------------


def test_dispatcher_never_picks_triton_for_cpu_tensors_by_default(monkeypatch):
    monkeypatch.delenv("GRIDSERVE_KERNELS", raising=False)
    monkeypatch.setattr(cpu_ops, "load", lambda: None)  # the C++ choice: test_cpu_paged_attention
    monkeypatch.setattr(cpu_ops, "load_layer_ops", lambda: None)  # and test_cpu_layer_ops
    assert dispatch._impl("rms_norm", torch.ones(1)) is reference.rms_norm
    assert select_attention_backend(torch.ones(1)).name == "cpu"  # C++ where it builds, else the reference


def test_dispatcher_uses_triton_when_forced(monkeypatch):
    monkeypatch.setenv("GRIDSERVE_KERNELS", "triton")
    assert select_attention_backend(torch.ones(1)).name == "triton"
    x, weight = torch.randn(2, 32), torch.randn(32)
    assert_matches(dispatch.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6))


def test_without_triton_the_import_fails_cleanly_and_dispatch_falls_back(monkeypatch):
    for name in [m for m in sys.modules if m.startswith("gridserve.kernels.triton_ops")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delattr(kernels_package, "triton_ops")
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` raise ImportError
    with pytest.raises(ImportError):
        importlib.import_module("gridserve.kernels.triton_ops")
    dispatch._triton_ops.cache_clear()
    monkeypatch.setattr(cpu_ops, "load_layer_ops", lambda: None)  # without the C++ op too
    try:
        monkeypatch.delenv("GRIDSERVE_KERNELS", raising=False)
        assert dispatch._impl("silu_and_mul", torch.ones(2)) is reference.silu_and_mul
        monkeypatch.setenv("GRIDSERVE_KERNELS", "triton")
        with pytest.raises(RuntimeError, match="no Triton kernel"):
            dispatch._impl("silu_and_mul", torch.ones(2))
    finally:
        dispatch._triton_ops.cache_clear()
