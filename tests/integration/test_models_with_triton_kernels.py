"""The models give the same tokens whichever kernel implementation the dispatcher picks.

Triton runs in its CPU interpreter here (``TRITON_INTERPRET=1``, set in conftest), so the check is
kept to a tiny checkpoint, two short prompts and a few steps.
"""

from __future__ import annotations

import pytest

from gridserve import LLM, SamplingParams

pytest.importorskip("triton")

PROMPTS = [{"prompt_token_ids": [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27]},
           {"prompt_token_ids": [300, 301, 302]}]


@pytest.mark.triton
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama_tiny", "opt_tiny"])
def test_triton_and_reference_kernels_give_the_same_tokens(arch, request, monkeypatch):
    llm = LLM(model=str(request.getfixturevalue(arch)), kv_cache_memory_bytes=8 << 20, max_model_len=128)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=2)
    monkeypatch.setenv("GRIDSERVE_KERNELS", "reference")
    reference = llm.generate(PROMPTS, params, use_tqdm=False)
    assert llm.reset_prefix_cache(), "the Triton run must recompute every token"
    from gridserve.kernels import triton_ops

    calls = []
    original = triton_ops.paged_attention
    monkeypatch.setattr(triton_ops, "paged_attention", lambda *a: calls.append(1) or original(*a))
    monkeypatch.setenv("GRIDSERVE_KERNELS", "triton")
    triton = llm.generate(PROMPTS, params, use_tqdm=False)
    assert calls, "the dispatcher did not pick the Triton kernels"
    for ref, tri in zip(reference, triton):
        assert tri.outputs[0].token_ids == ref.outputs[0].token_ids
        for ref_lp, tri_lp in zip(ref.outputs[0].logprobs, tri.outputs[0].logprobs):
            for token, lp in ref_lp.items():
                assert tri_lp[token].logprob == pytest.approx(lp.logprob, abs=1e-4)
