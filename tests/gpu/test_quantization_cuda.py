"""Quantized weights and narrow KV caches on a real GPU (skipped without one): the Triton kernels
reading 16-bit and fp8 caches against the torch reference on the same cache bytes, the int8 /
int4 CUDA matmuls against their dequantized weights, and ``LLM`` on CUDA in every mode.

Run by ``benchmarks/gpu_check.sh`` on a GPU machine with ``TRITON_INTERPRET=0``.
"""

from __future__ import annotations

import os

import pytest
import torch

from gridserve.kernels import reference

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        os.environ.get("TRITON_INTERPRET") == "1",
        reason="the Triton interpreter is on: these tests compile for the GPU",
    ),
]

CACHE_DTYPES = [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]


def _batch(query_dtype, cache_dtype, k_scale, v_scale):
    gen = torch.Generator().manual_seed(7)
    contexts, q_lens = [1, 17, 300, 40, 9], [1, 1, 1, 8, 9]
    page, kv_heads, heads, d = 16, 2, 8, 64
    pages = [(c + page - 1) // page for c in contexts]
    num_blocks = sum(pages) + 3
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(contexts), max(pages) + 1, dtype=torch.int32)
    for i, n in enumerate(pages):
        table[i, :n] = torch.tensor(order[:n])
        order = order[n:]
    kv = torch.randn(2, num_blocks, page, kv_heads, d, generator=gen)
    cache = torch.empty(kv.shape, dtype=cache_dtype)
    view = torch.uint8 if cache_dtype.itemsize == 1 else cache_dtype
    cache.view(view)[0] = reference.to_cache_dtype(kv[0], cache_dtype, k_scale).view(view)
    cache.view(view)[1] = reference.to_cache_dtype(kv[1], cache_dtype, v_scale).view(view)
    qsl = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    query = torch.randn(sum(q_lens), heads, d, generator=gen).to(query_dtype)
    return query, cache, qsl, torch.tensor(contexts, dtype=torch.int32), table


@pytest.mark.parametrize("query_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
def test_triton_attention_reads_a_narrow_cache_like_the_reference(query_dtype, cache_dtype):
    from gridserve.kernels import triton_ops

    if query_dtype.itemsize < cache_dtype.itemsize:
        pytest.skip("a cache is never wider than the query")
    k_scale, v_scale = (0.5, 2.0) if cache_dtype.itemsize == 1 else (1.0, 1.0)
    batch = _batch(query_dtype, cache_dtype, k_scale, v_scale)
    want = reference.paged_attention(batch[0].float(), *batch[1:], 0.125, None, k_scale, v_scale)
    got = triton_ops.paged_attention(*(t.cuda() for t in batch), 0.125, None, k_scale, v_scale)
    tol = 1e-4 if query_dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.float().cpu(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES, ids=str)
def test_triton_cache_write_stores_the_same_bytes_as_the_reference(cache_dtype):
    from gridserve.kernels import triton_ops

    gen = torch.Generator().manual_seed(3)
    key, value = torch.randn(6, 2, 64, generator=gen) * 50, torch.randn(6, 2, 64, generator=gen)
    slots = torch.tensor([3, 9, 17, 30, 31, 0])
    want = torch.zeros(2, 4, 16, 2, 64, dtype=cache_dtype)
    reference.reshape_and_cache(key, value, want, slots, 0.25, 2.0)
    got = torch.zeros(2, 4, 16, 2, 64, dtype=cache_dtype, device="cuda")
    triton_ops.reshape_and_cache(key.cuda(), value.cuda(), got, slots.cuda(), 0.25, 2.0)
    torch.testing.assert_close(got.cpu().float(), want.float(), atol=0, rtol=0.13)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_matmul_on_cuda_matches_its_dequantized_weight(method):
    from gridserve.services.worker.quantization import quantize_weight

    gen = torch.Generator().manual_seed(5)
    q = quantize_weight(torch.randn(512, 384, generator=gen), method).cuda()
    x = torch.randn(33, 384, generator=gen).cuda()
    torch.testing.assert_close(q(x), x @ q.dequantize().T, atol=1e-3, rtol=1e-3)


def test_llm_on_cuda_runs_every_mode_close_to_fp32():
    from transformers import AutoTokenizer

    from gridserve.benchmarks import quantization as bench
    from gridserve.demo.recipe import ensure_checkpoint

    model = str(ensure_checkpoint("llama", "small"))
    ids = AutoTokenizer.from_pretrained(model)(bench.held_out_text())["input_ids"]
    modes = ["kv-bf16", "kv-fp8_e4m3", "int8", "int4+kv-fp8"]
    results = bench.evaluate(
        model,
        ids[:384],
        [ids[400:424]],
        modes,
        32,
        device="cuda",
        kv_cache_memory_bytes=1 << 26,
        max_model_len=1024,
    )
    by_mode = {r.mode: r for r in results}
    print({m: round(r.mean_kl, 5) for m, r in by_mode.items()})
    assert by_mode["kv-bf16"].mean_kl <= bench.BARS["kv-bf16"][0]
    assert by_mode["int8"].mean_kl < 0.1  # weight-only on CUDA: tighter than W8A8
