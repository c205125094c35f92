"""The compiled Triton kernels' new paths on a real GPU (skipped without one, and under the
interpreter): paged attention with a sliding window, soft cap and ALiBi (decode, split-K decode,
prefill and chunked prefill past the window; fp32 / fp16 / bf16) against the dense float64
answer computed on the CPU, GELU-and-mul against ``F.gelu``, and how much a window saves a
long-context decode. Run by ``benchmarks/gpu_check.sh`` (``TRITON_INTERPRET=0``)."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.nn.functional as F

from tests.unit.kernels.dense_attention import dense_attention, paged_batch, upcast

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="the Triton interpreter is on: these tests compile for the GPU"),
]
# 16-bit attention rounds P to 16 bits before P @ V (as FlashAttention does)
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 4e-2}
MODS = [{"sliding_window": 100}, {"soft_cap": 30.0}, {"alibi": True},
        {"sliding_window": 77, "soft_cap": 5.0, "alibi": True}]


def _mods(mods: dict, heads: int) -> dict:
    from gridserve.kernels import reference

    mods = dict(mods)
    if mods.pop("alibi", False):
        mods["alibi_slopes"] = reference.alibi_slopes(heads)
    return mods


def _check(batch, scale, max_query_len, mods):
    from gridserve.kernels import triton_ops

    cuda = [t.cuda() for t in batch]
    slopes = mods.get("alibi_slopes")
    out = triton_ops.paged_attention(*cuda, scale, max_query_len, **{
        **mods, "alibi_slopes": None if slopes is None else slopes.cuda()})
    want = dense_attention(*upcast(batch), scale, window=mods.get("sliding_window", 0),
                           soft_cap=mods.get("soft_cap", 0.0), slopes=slopes)
    tol = TOL[batch[0].dtype]
    torch.testing.assert_close(out.cpu().double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mods", MODS, ids=["window", "cap", "alibi", "all"])
def test_decode_on_cuda(dtype, mods):
    contexts = [1, 16, 17, 100, 333, 700, 2049]  # the long few take split-K
    batch = paged_batch(contexts, [1] * len(contexts), 32, 8, 128, 16, dtype)
    _check(batch, 128**-0.5, 1, _mods(mods, 32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mods", MODS, ids=["window", "cap", "alibi", "all"])
def test_prefill_and_chunked_prefill_past_the_window_on_cuda(dtype, mods):
    batch = paged_batch([300, 700, 40, 1, 129], [300, 64, 8, 1, 2], 12, 4, 64, 16, dtype)
    _check(batch, 0.125, 300, _mods(mods, 12))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_and_mul_on_cuda(dtype, approximate):
    from gridserve.kernels import triton_ops

    x = (torch.randn(7, 2 * 1000) * 3).to(dtype).cuda()
    gate, up = x.chunk(2, -1)
    tol = {torch.float32: (2e-6, 1e-6), torch.bfloat16: (1e-2, 1.6e-2)}[dtype]
    torch.testing.assert_close(triton_ops.gelu_and_mul(x, approximate), F.gelu(gate, approximate=approximate) * up,
                               atol=tol[0], rtol=tol[1])
    torch.testing.assert_close(triton_ops.gelu(x, approximate), F.gelu(x, approximate=approximate),
                               atol=tol[0], rtol=tol[1])


def test_a_sliding_window_makes_long_decode_cheaper_on_cuda():
    from gridserve.kernels import triton_ops

    batch = [t.cuda() for t in paged_batch([32768] * 8, [1] * 8, 32, 8, 128, 16, torch.bfloat16)]

    def ms(**mods):
        for _ in range(3):
            triton_ops.paged_attention(*batch, 0.088, 1, **mods)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(20):
            triton_ops.paged_attention(*batch, 0.088, 1, **mods)
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / 20 * 1e3

    plain, windowed, capped = ms(), ms(sliding_window=4096), ms(soft_cap=50.0)
    print(f"decode 8 x 32k ctx, 32/8 heads x 128, bf16: plain {plain:.3f} ms, window 4096 {windowed:.3f} ms, "
          f"soft cap {capped:.3f} ms")
    assert windowed < plain
