"""Turns a step's logits into one token per request, for the whole batch in one call.

Order (as vLLM): logprobs of the raw model distribution -> min_tokens masking -> greedy or
temperature -> min_p -> top_k / top_p -> sample. Random rows draw by the exponential race
(``argmax(p / q)`` with ``q ~ Exp(1)``); a request with a ``seed`` draws ``q`` from its own
generator, so its tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from gridserve.shared.scheduler_output import TokenLogprobs

_NEG_INF = float("-inf")


@dataclass
class SamplingMetadata:
    """Per-row sampling parameters of one step, as tensors (rows = requests that sample)."""

    temperature: torch.Tensor  # [B] float32; 0 for greedy rows
    top_p: torch.Tensor  # [B] float32
    top_k: torch.Tensor  # [B] int64; vocab size when disabled
    min_p: torch.Tensor  # [B] float32
    all_greedy: bool
    need_top_k_top_p: bool
    need_min_p: bool
    generators: dict[int, torch.Generator]  # row -> per-request generator (seeded rows)
    banned_token_ids: dict[int, list[int]]  # row -> ids masked this step (min_tokens)
    max_num_logprobs: Optional[int]  # None when no row asked for logprobs
    num_logprobs: list[Optional[int]]


class Sampler:
    """Stateless batched sampler."""

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> tuple[torch.Tensor, list]:
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if meta.max_num_logprobs is not None else None
        for row, ids in meta.banned_token_ids.items():
            logits[row, ids] = _NEG_INF
        if meta.all_greedy:
            sampled = logits.argmax(dim=-1)
        else:
            sampled = self._sample(logits, meta)
        logprobs = self._gather_logprobs(raw_logprobs, sampled, meta) if raw_logprobs is not None else []
        return sampled, logprobs

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        greedy = meta.temperature == 0
        greedy_tokens = logits.argmax(dim=-1)
        temperature = torch.where(greedy, torch.ones_like(meta.temperature), meta.temperature)
        logits = logits / temperature.unsqueeze(1)
        if meta.need_min_p:
            probs = logits.softmax(dim=-1)
            threshold = probs.amax(dim=-1, keepdim=True) * meta.min_p.unsqueeze(1)
            logits = logits.masked_fill(probs < threshold, _NEG_INF)
        if meta.need_top_k_top_p:
            logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
        probs = logits.softmax(dim=-1)
        q = torch.empty_like(probs).exponential_()
        for row, generator in meta.generators.items():
            q[row].exponential_(generator=generator)
        random_tokens = probs.div(q).argmax(dim=-1)
        return torch.where(greedy, greedy_tokens, random_tokens)

    @staticmethod
    def _gather_logprobs(logprobs: torch.Tensor, sampled: torch.Tensor, meta: SamplingMetadata) -> list:
        top_vals, top_ids = logprobs.topk(max(meta.max_num_logprobs, 1), dim=-1)
        sampled_lp = logprobs.gather(1, sampled.unsqueeze(1)).squeeze(1)
        ranks = (logprobs > sampled_lp.unsqueeze(1)).sum(dim=-1) + 1
        top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
        sampled_list, sampled_lp, ranks = sampled.tolist(), sampled_lp.tolist(), ranks.tolist()
        out: list[Optional[TokenLogprobs]] = []
        for row, n in enumerate(meta.num_logprobs):
            if n is None:
                out.append(None)
                continue
            out.append(
                TokenLogprobs(
                    token_ids=[sampled_list[row], *top_ids[row][:n]],
                    logprobs=[sampled_lp[row], *top_vals[row][:n]],
                    sampled_rank=ranks[row],
                )
            )
        return out


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask logits outside each row's top-k and outside its top-p nucleus (one sort for the batch)."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    # top-k: keep the last k of the ascending order
    cutoff = (vocab - top_k.clamp(min=1, max=vocab)).unsqueeze(1)
    positions = torch.arange(vocab, device=logits.device).unsqueeze(0)
    sorted_logits = sorted_logits.masked_fill(positions < cutoff, _NEG_INF)
    # top-p: drop the low tail whose cumulative mass is <= 1 - p, always keeping the best token
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    tail = cumulative <= (1 - top_p).unsqueeze(1)
    tail[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(tail, _NEG_INF)
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
