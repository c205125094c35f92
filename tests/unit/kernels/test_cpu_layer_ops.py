"""The C++ CPU layer ops (``cpu_ops``: RMSNorm, fused add + RMSNorm, RoPE, SiLU-and-mul, KV-cache
write) against the torch reference, on the AVX-512 path and the portable loops.

RoPE, the residual add and the cache write (fp8 included) must give the reference's bits; RMSNorm
(sum order) and SiLU (exp) may differ by float rounding: fp32 within ~1e-6 relative, 16-bit types
by two units in the last place of the output dtype (a one-ulp flip of the normalized value in
the dtype, then scaled by the weight and rounded again).
"""

from __future__ import annotations

import pytest
import torch

from gridserve import kernels
from gridserve.kernels import cpu_ops, dispatch, reference
from tests.missing_tool import missing

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CACHE_DTYPES = DTYPES + [torch.float8_e4m3fn, torch.float8_e5m2]


@pytest.fixture(scope="module")
def ops():
    built = cpu_ops.load_layer_ops()
    if built is None:
        missing("the C++ CPU layer ops cannot be built here (see the logged reason)")
    return built


@pytest.fixture(params=["avx512", "portable"])
def isa(request, ops):
    """Each test on both instruction paths (the AVX-512 one only where the CPU has it)."""
    if request.param == "avx512" and ops.layer_ops_isa() < 1:
        pytest.skip("no AVX-512 here")
    before = ops.layer_ops_isa()
    ops.layer_ops_isa(1 if request.param == "avx512" else 0)
    yield request.param
    ops.layer_ops_isa(max(before, 1))


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, exact: bool = False) -> None:
    """fp32: ~2e-6 relative; 16-bit: two units in the last place of the dtype; ``exact``: same bits."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if exact:
        assert torch.equal(actual, expected), (actual - expected).abs().max()
        return
    eps = torch.finfo(expected.dtype).eps
    a, e = actual.double(), expected.double()
    tol = (2e-6 if expected.dtype == torch.float32 else 2 * eps) * torch.maximum(a.abs(), e.abs()) + 1e-30
    diff = (a - e).abs()
    assert bool((diff <= tol).all()), f"max diff {diff.max().item():.3g}, worst rel {(diff / tol).max().item():.3g} tol"


def rand(*shape, dtype=torch.float32, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, hidden", [(1, 768), (7, 771), (2048, 768), (3, 5), (5, 4096)])
def test_rms_norm(isa, dtype, tokens, hidden):
    x, weight = rand(tokens, hidden, dtype=dtype, seed=1), rand(hidden, dtype=dtype, seed=2)
    assert_matches(cpu_ops.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, hidden", [(1, 768), (7, 771), (2048, 768), (2, 17)])
def test_fused_add_rms_norm(isa, dtype, tokens, hidden):
    x, residual = rand(tokens, hidden, dtype=dtype, seed=3), rand(tokens, hidden, dtype=dtype, seed=4)
    weight = rand(hidden, dtype=dtype, seed=5)
    normed, summed = cpu_ops.fused_add_rms_norm(x, residual, weight, 1e-5)
    ref_normed, ref_summed = reference.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert_matches(summed, ref_summed, exact=True)
    assert_matches(normed, ref_normed)
    assert not torch.equal(summed, residual)  # a new tensor; the inputs are left alone
    assert torch.equal(residual, rand(tokens, hidden, dtype=dtype, seed=4))


def test_rms_norm_takes_3d_and_strided_rows(isa):
    base = rand(4, 6, 800, seed=6)
    x = base[:, :, :768]  # rows strided by 800
    weight = rand(768, seed=7)
    assert_matches(cpu_ops.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6))
    residual = rand(4, 6, 768, seed=8)
    for a, b in zip(cpu_ops.fused_add_rms_norm(x, residual, weight, 1e-6),
                    reference.fused_add_rms_norm(x, residual, weight, 1e-6)):
        assert_matches(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("head_size, rotary_dim", [(64, 64), (128, 128), (64, 32), (80, 40), (64, 24), (96, 96)])
@pytest.mark.parametrize("tokens", [1, 13, 2048])
def test_rotary_embedding_on_fused_qkv_views(isa, dtype, is_neox, head_size, rotary_dim, tokens):
    heads, kv_heads = 12, 4  # GQA: fewer key heads
    qkv = rand(tokens, (heads + 2 * kv_heads) * head_size, dtype=dtype, seed=9)
    q = qkv[:, : heads * head_size].view(tokens, heads, head_size)
    k = qkv[:, heads * head_size : (heads + kv_heads) * head_size].view(tokens, kv_heads, head_size)
    assert tokens == 1 or not (q.is_contiguous() or k.is_contiguous())
    positions = torch.randint(0, 4096, (tokens,), generator=torch.Generator().manual_seed(10))
    cos_sin = rand(4096, rotary_dim, seed=11)
    got = cpu_ops.rotary_embedding(positions, q, k, cos_sin, is_neox)
    want = reference.rotary_embedding(positions, q, k, cos_sin, is_neox)
    for a, b in zip(got, want):
        assert_matches(a, b, exact=True)
    assert torch.equal(got[0][..., rotary_dim:], q[..., rotary_dim:])  # the tail passes through


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
def test_rotary_embedding_with_a_16bit_table(isa, cache_dtype):
    q, k = rand(9, 8, 64, seed=12), rand(9, 2, 64, seed=13)
    positions = torch.tensor([0, 5, 3, 99, 1, 1, 7, 50, 2], dtype=torch.int32)
    cos_sin = rand(100, 64, dtype=cache_dtype, seed=14)
    for neox in (True, False):
        for a, b in zip(cpu_ops.rotary_embedding(positions, q, k, cos_sin, neox),
                        reference.rotary_embedding(positions.long(), q, k, cos_sin, neox)):
            assert_matches(a, b, exact=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, d", [(1, 2048), (9, 1003), (2048, 2048), (4, 3)])
def test_silu_and_mul(isa, dtype, tokens, d):
    x = rand(tokens, 2 * d, dtype=dtype, seed=15, scale=4.0)
    x[0, :3] = torch.tensor([-200.0, 200.0, 0.0]).to(dtype)  # exp over- and underflow
    assert_matches(cpu_ops.silu_and_mul(x), reference.silu_and_mul(x))


def test_silu_and_mul_takes_3d_input(isa):
    x = rand(2, 5, 2 * 48, seed=16)
    assert_matches(cpu_ops.silu_and_mul(x), reference.silu_and_mul(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize("tokens", [1, 37, 2048])
def test_reshape_and_cache(isa, dtype, cache_dtype, tokens):
    kv_heads, head_size, block_size = 4, 64, 16
    num_blocks = tokens // block_size + 6
    qkv = rand(tokens, (12 + 2 * kv_heads) * head_size, dtype=dtype, seed=17, scale=200.0)  # saturates e4m3
    k = qkv[:, 12 * head_size : (12 + kv_heads) * head_size].view(tokens, kv_heads, head_size)
    v = qkv[:, (12 + kv_heads) * head_size :].view(tokens, kv_heads, head_size)
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(18))[:tokens]
    start = rand(2, num_blocks, block_size, kv_heads, head_size, seed=19).to(cache_dtype)
    got, want = start.clone(), start.clone()
    k_scale, v_scale = (0.37, 3.1) if cache_dtype in reference.FP8_DTYPES else (1.0, 1.0)
    cpu_ops.reshape_and_cache(k, v, got, slots, k_scale, v_scale)
    reference.reshape_and_cache(k, v, want, slots, k_scale, v_scale)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert not torch.equal(got.view(torch.uint8), start.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cache_dtype", reference.FP8_DTYPES)
def test_fp8_cache_rounding_of_every_range(isa, dtype, cache_dtype):
    """Subnormals, ties, values at and past the format's max, +-0, inf and NaN: the reference's bits."""
    gen = torch.Generator().manual_seed(29)
    n = 64 * 1024
    exponents = torch.randint(-30, 20, (n,), generator=gen).float()
    values = torch.sign(torch.randn(n, generator=gen)) * torch.rand(n, generator=gen).add(1) * 2.0**exponents
    ties = torch.arange(0, 512, dtype=torch.float32) * 2.0**-12  # exact halfway points of both formats
    fmax = torch.finfo(cache_dtype).max
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), fmax, -fmax, fmax * 1.03,
                             fmax * 1.2, 2.0**-9, 2.0**-10, 2.0**-16, 2.0**-17, 3 * 2.0**-11])
    flat = torch.cat([values, ties, -ties, specials])
    flat = flat[: flat.numel() // 64 * 64].to(dtype)
    k = flat.view(-1, 1, 64)
    v = -k
    cache = torch.zeros(2, k.shape[0], 1, 1, 64, dtype=cache_dtype)
    want = cache.clone()
    slots = torch.arange(k.shape[0])
    for k_scale in (1.0, 0.37):
        cpu_ops.reshape_and_cache(k, v, cache, slots, k_scale, 1.0)
        reference.reshape_and_cache(k, v, want, slots, k_scale, 1.0)
        assert torch.equal(cache.view(torch.uint8), want.view(torch.uint8))


def test_reshape_and_cache_skips_padding_slots(isa):
    k, v = rand(3, 2, 16, seed=20), rand(3, 2, 16, seed=21)
    cache = torch.zeros(2, 2, 4, 2, 16)
    cpu_ops.reshape_and_cache(k, v, cache, torch.tensor([5, -1, 2]))
    flat = cache.view(2, 8, 2, 16)
    assert torch.equal(flat[0, 5], k[0]) and torch.equal(flat[1, 2], v[2])
    assert flat[:, [0, 1, 3, 4, 6, 7]].abs().sum() == 0


def test_rows_do_not_depend_on_the_batch(isa):
    """Batch invariance: a row's result is the same bits alone, in a batch of 2,048, on 2 threads."""
    x, residual = rand(2048, 768, seed=22), rand(2048, 768, seed=23)
    weight = rand(768, seed=24)
    gate_up = rand(2048, 2 * 2048, seed=25, scale=3.0)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        full = (cpu_ops.rms_norm(x, weight, 1e-6), *cpu_ops.fused_add_rms_norm(x, residual, weight, 1e-6),
                cpu_ops.silu_and_mul(gate_up))
    finally:
        torch.set_num_threads(before)
    for row in (0, 1000, 2047):
        alone = (cpu_ops.rms_norm(x[row : row + 1], weight, 1e-6),
                 *cpu_ops.fused_add_rms_norm(x[row : row + 1], residual[row : row + 1], weight, 1e-6),
                 cpu_ops.silu_and_mul(gate_up[row : row + 1]))
        for a, b in zip(alone, full):
            assert torch.equal(a[0], b[row])


def test_unsupported_inputs_fall_back_to_the_reference(ops):
    x = rand(3, 16).double()
    weight = rand(16).double()
    assert torch.equal(cpu_ops.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6))
    x32, w16 = rand(3, 16), rand(16, dtype=torch.bfloat16)  # mixed dtypes: the reference promotes
    out = cpu_ops.rms_norm(x32, w16, 1e-6)
    assert out.dtype == torch.float32 and torch.equal(out, reference.rms_norm(x32, w16, 1e-6))
    strided = rand(4, 32)[:, ::2]  # last dim not contiguous
    assert torch.equal(cpu_ops.silu_and_mul(strided), reference.silu_and_mul(strided))


def test_dispatch_picks_the_cpp_ops_on_cpu(ops, monkeypatch):
    monkeypatch.setenv("GRIDSERVE_KERNELS", "auto")
    x = torch.zeros(4, 768)
    for name in ("rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul", "reshape_and_cache"):
        assert name in cpu_ops.KERNELS
        assert dispatch._impl(name, x) is getattr(cpu_ops, name)
        assert dispatch._serial_impl(name, x) is dispatch._one_thread(getattr(cpu_ops, name))
    monkeypatch.setenv("GRIDSERVE_KERNELS", "reference")
    assert dispatch._impl("rms_norm", x) is reference.rms_norm
    # and the public entry points compute through them
    monkeypatch.setenv("GRIDSERVE_KERNELS", "auto")
    q, k = rand(5, 12, 64, seed=26), rand(5, 4, 64, seed=27)
    positions, cos_sin = torch.arange(5), rand(16, 64, seed=28)
    for a, b in zip(kernels.rotary_embedding(positions, q, k, cos_sin), reference.rotary_embedding(positions, q, k, cos_sin)):
        assert torch.equal(a, b)
