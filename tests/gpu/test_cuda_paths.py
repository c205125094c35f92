"""The CUDA paths, run for real on a GPU (skipped without one): compiled Triton kernels (no
interpreter) against the torch reference, and the offline ``LLM`` on CUDA token-exact with
Hugging Face transformers on the same checkpoint and device.

Run by ``benchmarks/gpu_check.sh`` on a GPU machine with ``TRITON_INTERPRET=0``; on CPU-only
machines every test here skips.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="the Triton interpreter is on: these tests compile for the GPU"),
]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}
# Attention in 16-bit rounds P to 16 bits before P @ V (as FlashAttention does): a looser bar.
ATTN_TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 4e-2}


def _close(actual: torch.Tensor, expected: torch.Tensor, table=TOLERANCE) -> None:
    tol = table[expected.dtype]
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


def _paged_batch(contexts, q_lens, heads, kv_heads, head_size, page, dtype):
    """Query, cache and metadata on CUDA; each sequence's blocks scattered over a larger cache."""
    gen = torch.Generator().manual_seed(sum(contexts) + heads + page)
    pages = [(c + page - 1) // page for c in contexts]
    num_blocks = sum(pages) + 5
    scattered = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    block_table = torch.zeros(len(contexts), max(pages) + 1, dtype=torch.int32)
    for seq, n in enumerate(pages):
        block_table[seq, :n] = torch.tensor(scattered[:n])
        scattered = scattered[n:]
    kv_cache = torch.randn(2, num_blocks, page, kv_heads, head_size, generator=gen).to(dtype)
    query_start_loc = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    query = torch.randn(sum(q_lens), heads, head_size, generator=gen).to(dtype)
    seq_lens = torch.tensor(contexts, dtype=torch.int32)
    return tuple(t.cuda() for t in (query, kv_cache, query_start_loc, seq_lens, block_table))


def _reference_on_cpu(fn, tensors, *args):
    """The torch reference on CPU copies in float32: an independent answer for the GPU kernels."""
    cpu = [t.cpu().float() if t.is_floating_point() else t.cpu() for t in tensors]
    return fn(*cpu, *args)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_size", "page"),
                         [(8, 2, 64, 16), (4, 1, 128, 16), (32, 8, 128, 16), (2, 2, 64, 32)])
def test_triton_decode_on_cuda_matches_reference(dtype, heads, kv_heads, head_size, page):
    from gridserve.kernels import reference, triton_ops

    contexts = [1, 16, 17, 48, 100, 33, 700, 2049]
    batch = _paged_batch(contexts, [1] * len(contexts), heads, kv_heads, head_size, page, dtype)
    scale = head_size**-0.5
    out = triton_ops.paged_attention(*batch, scale, 1)
    assert out.is_cuda
    _close(out.cpu().float().to(dtype), _reference_on_cpu(reference.paged_attention, batch, scale).to(dtype),
           ATTN_TOLERANCE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("head_size", "page"), [(64, 16), (128, 32)])
def test_triton_prefill_and_chunked_prefill_on_cuda_match_reference(dtype, head_size, page):
    from gridserve.kernels import reference, triton_ops

    batch = _paged_batch([17, 37, 16, 1, 40, 300], [17, 5, 1, 1, 8, 200], 6, 2, head_size, page, dtype)
    scale = head_size**-0.5
    out = triton_ops.paged_attention(*batch, scale)
    _close(out.cpu().float().to(dtype), _reference_on_cpu(reference.paged_attention, batch, scale).to(dtype),
           ATTN_TOLERANCE)


def test_split_k_is_chosen_for_few_long_sequences_and_matches_reference():
    from gridserve.kernels import reference, triton_ops
    from gridserve.kernels.triton_ops import attention

    batch = _paged_batch([4000, 7], [1, 1], 32, 8, 128, 16, torch.float16)
    plan = attention.plan_attention(batch[0], batch[1], batch[4], 2, 1)
    assert plan.num_splits > 1
    out = triton_ops.paged_attention(*batch, 128**-0.5, 1)
    _close(out.cpu().float().half(), _reference_on_cpu(reference.paged_attention, batch, 128**-0.5).half(),
           ATTN_TOLERANCE)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reshape_and_cache_on_cuda_writes_the_reference_slots(dtype):
    from gridserve.kernels import reference, triton_ops

    key, value = torch.randn(2, 9, 2, 64).to(dtype)
    slots = torch.randperm(6 * 16)[:9]
    expected = torch.zeros(2, 6, 16, 2, 64, dtype=dtype)
    reference.reshape_and_cache(key, value, expected, slots)
    actual = torch.zeros(2, 6, 16, 2, 64, dtype=dtype, device="cuda")
    triton_ops.reshape_and_cache(key.cuda(), value.cuda(), actual, slots.cuda())
    assert torch.equal(actual.cpu(), expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_rotary_and_activation_on_cuda_match_reference(dtype):
    from gridserve.kernels import reference, triton_ops

    x, residual = torch.randn(2, 7, 96).to(dtype).cuda()
    weight = torch.randn(96).to(dtype).cuda()
    _close(triton_ops.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6))
    out, new_residual = triton_ops.fused_add_rms_norm(x, residual, weight, 1e-6)
    ref_out, ref_residual = reference.fused_add_rms_norm(x, residual, weight, 1e-6)
    _close(out, ref_out)
    _close(new_residual, ref_residual)

    inv_freq = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    freqs = torch.outer(torch.arange(64).float(), inv_freq)
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).cuda()
    positions = torch.tensor([0, 5, 63, 17, 17, 2]).cuda()
    query, key = torch.randn(6, 4, 64).to(dtype).cuda(), torch.randn(6, 2, 64).to(dtype).cuda()
    for is_neox in (True, False):
        q_out, k_out = triton_ops.rotary_embedding(positions, query.clone(), key.clone(), cache, is_neox)
        q_ref, k_ref = reference.rotary_embedding(positions, query.clone(), key.clone(), cache, is_neox)
        _close(q_out, q_ref)
        _close(k_out, k_ref)

    act = torch.randn(3, 4, 80).to(dtype).cuda()
    _close(triton_ops.silu_and_mul(act), reference.silu_and_mul(act))


def test_dispatch_picks_triton_for_cuda_tensors(monkeypatch):
    from gridserve.kernels import dispatch, select_attention_backend, triton_ops

    monkeypatch.delenv("GRIDSERVE_KERNELS", raising=False)
    assert select_attention_backend(torch.ones(1, device="cuda")).name == "triton"
    assert dispatch._impl("rms_norm", torch.ones(1, device="cuda")) is triton_ops.rms_norm


# --- the whole engine on CUDA against transformers on CUDA -------------------------------------


def _prompts(count, min_len, max_len, seed, vocab=4096):
    rng = random.Random(seed)
    return [[rng.randrange(6, vocab) for _ in range(rng.randint(min_len, max_len))] for _ in range(count)]


@torch.inference_mode()
def _hf_greedy_cuda(model, prompt_ids, n):
    ids = torch.tensor([prompt_ids], device="cuda")
    out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         attention_mask=torch.ones_like(ids))
    return out[0, len(prompt_ids):].tolist()


@pytest.mark.parametrize("arch", ["llama_tiny", "qwen2_tiny", "mistral_tiny", "opt_tiny"])
def test_llm_on_cuda_is_token_exact_with_transformers_on_cuda(arch, request):
    from transformers import AutoModelForCausalLM

    from gridserve import LLM, SamplingParams

    path = str(request.getfixturevalue(arch))
    llm = LLM(model=path, device="cuda", kv_cache_memory_bytes=256 << 20, max_num_batched_tokens=96)
    worker = llm.llm_engine.core.executor
    prompts = _prompts(16, 1, 200, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    mismatches = [i for i, (p, o) in enumerate(zip(prompts, outs))
                  if o.outputs[0].token_ids != _hf_greedy_cuda(hf, p, 16)]
    assert not mismatches, f"{arch}: prompts {mismatches} diverge from transformers on CUDA ({worker})"
    kv = llm.llm_engine.core.kv_cache_manager
    assert kv.num_free_blocks == kv.num_total_blocks
