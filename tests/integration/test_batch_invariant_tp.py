"""Batch-invariant mode with tensor parallelism: two worker processes (row-parallel partial sums
all-reduced over gloo, the LM head gathered), seeded requests alone and in two batch orders give
the same tokens with bitwise equal logprobs."""

from __future__ import annotations

import torch

from gridserve import LLM, SamplingParams


def test_tp2_seeded_tokens_and_logprobs_do_not_depend_on_the_batch_mix(llama_tiny):
    llm = LLM(model=str(llama_tiny), tensor_parallel_size=2, batch_invariant=True,
              kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=64, max_model_len=256)
    try:
        prompts = [{"prompt_token_ids": torch.randint(4, 4096, (5 + 11 * i % 37,),
                                                      generator=torch.Generator().manual_seed(300 + i)).tolist()}
                   for i in range(12)]
        params = [SamplingParams(temperature=1.3, seed=7 + i, max_tokens=24, ignore_eos=True, logprobs=1)
                  for i in range(12)]

        def run(order: list[int]) -> dict:
            outs = llm.generate([prompts[i] for i in order], [params[i] for i in order], use_tqdm=False)
            return {i: (list(c.token_ids), [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)])
                    for i, c in ((i, o.outputs[0]) for i, o in zip(order, outs))}

        alone = {i: run([i])[i] for i in (0, 5, 11)}
        mixed = run(list(range(12)))
        assert run(list(reversed(range(12)))) == mixed
        assert all(mixed[i] == alone[i] for i in alone)
    finally:
        llm.shutdown()
