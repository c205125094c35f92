"""Reference outputs from Hugging Face transformers on the same checkpoint."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=8)
def hf_model(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.inference_mode()
def hf_greedy(path: str, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """Greedy continuation of exactly ``num_tokens`` tokens (EOS suppressed until then)."""
    ids = torch.tensor([prompt_ids])
    out = hf_model(path).generate(
        ids, max_new_tokens=num_tokens, min_new_tokens=num_tokens, do_sample=False,
        attention_mask=torch.ones_like(ids),
    )
    return out[0, len(prompt_ids):].tolist()


@torch.inference_mode()
def hf_top_logprobs(path: str, prompt_ids: list[int], greedy_ids: list[int], k: int) -> list[tuple[list[int], list[float]]]:
    """Top-k (ids, logprobs) at each position of the prompt's greedy continuation."""
    ids = torch.tensor([prompt_ids + greedy_ids[:-1]])
    logits = hf_model(path)(ids).logits[0, len(prompt_ids) - 1 :].float()
    vals, idx = torch.log_softmax(logits, -1).topk(k, -1)
    return [(i.tolist(), v.tolist()) for i, v in zip(idx, vals)]
