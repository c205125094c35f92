"""KV caches narrower than the model (``kv_cache_dtype``): 16-bit and fp8 with per-tensor scales.

The reference stores and reads them; the C++ kernel reads them in place and must agree with the
reference on the same cache bytes. The error against an fp32 cache is bounded by the format.
"""

from __future__ import annotations

import pytest
import torch

from gridserve.kernels import cpu_ops, reference
from tests.missing_tool import missing
from tests.unit.kernels.test_cpu_paged_attention import paged_batch

CONTEXTS = [1, 15, 17, 300, 64, 5, 40]
Q_LENS = [1, 1, 1, 1, 1, 5, 9]  # decode rows and prefill rows in one call
NARROW = [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]
# Worst element error of attention outputs against an fp32 cache, per storage format.
TOLERANCE = {
    torch.bfloat16: 2e-2,
    torch.float16: 3e-3,
    torch.float8_e4m3fn: 0.12,
    torch.float8_e5m2: 0.25,
}


def narrowed(
    kv_cache: torch.Tensor, dtype: torch.dtype, k_scale: float, v_scale: float
) -> torch.Tensor:
    out = torch.empty(kv_cache.shape, dtype=dtype)
    out.view(torch.uint8 if dtype.itemsize == 1 else dtype)[0] = reference.to_cache_dtype(
        kv_cache[0], dtype, k_scale
    ).view(torch.uint8 if dtype.itemsize == 1 else dtype)
    out.view(torch.uint8 if dtype.itemsize == 1 else dtype)[1] = reference.to_cache_dtype(
        kv_cache[1], dtype, v_scale
    ).view(torch.uint8 if dtype.itemsize == 1 else dtype)
    return out


@pytest.mark.parametrize("dtype", NARROW, ids=str)
def test_reference_over_a_narrow_cache_stays_close_to_fp32(dtype):
    query, kv, qsl, lens, table = paged_batch(CONTEXTS, Q_LENS, 8, 2, 64)
    k_scale, v_scale = (0.5, 2.0) if dtype.itemsize == 1 else (1.0, 1.0)
    expected = reference.paged_attention(query, kv, qsl, lens, table, 0.125)
    cache = narrowed(kv, dtype, k_scale, v_scale)
    out = reference.paged_attention(query, cache, qsl, lens, table, 0.125, None, k_scale, v_scale)
    assert out.dtype == torch.float32
    assert (out - expected).abs().max().item() <= TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", NARROW, ids=str)
def test_cpp_kernel_reads_a_narrow_cache_like_the_reference(dtype):
    if cpu_ops.load() is None:
        missing("the C++ CPU extension cannot be built here")
    query, kv, qsl, lens, table = paged_batch(CONTEXTS, Q_LENS, 8, 2, 64)
    k_scale, v_scale = (0.5, 2.0) if dtype.itemsize == 1 else (1.0, 1.0)
    cache = narrowed(kv, dtype, k_scale, v_scale)
    got = cpu_ops.paged_attention(query, cache, qsl, lens, table, 0.125, None, k_scale, v_scale)
    want = reference.paged_attention(query, cache, qsl, lens, table, 0.125, None, k_scale, v_scale)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_fp8_write_divides_by_the_scale_and_saturates(dtype):
    cache = torch.zeros(2, 3, 4, 1, 2, dtype=dtype)
    key = torch.tensor([[[1.0, 1e9]]])
    value = torch.tensor([[[-3.0, 0.25]]])
    reference.reshape_and_cache(key, value, cache, torch.tensor([5]), 2.0, 0.5)
    stored = cache.float().view(2, 12, 1, 2)[:, 5, 0]
    limit = torch.finfo(dtype).max
    assert stored[0].tolist() == [0.5, limit]
    assert stored[1].tolist() == [-6.0, 0.5]
