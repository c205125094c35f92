"""Turns a step's logits into one token per request, for the whole batch in one call.

Order (as vLLM): logprobs of the raw model distribution -> allowed token ids -> banned ids (bad
words, min_tokens) -> logit bias -> penalties (repetition, frequency, presence) -> greedy or
temperature -> min_p -> top_k / top_p -> sample.

Random rows sample by inverse CDF: one uniform ``u`` per row picks the first token whose cumulative
probability exceeds ``u`` (one ``cumsum`` and one ``searchsorted`` for the whole batch, 8-10x cheaper
here than drawing an exponential per vocabulary entry). A seeded row's ``u`` is a pure function of
(seed, index of the token being sampled) — ``counter_uniform`` — so token k comes out the same
whichever batch, worker, engine or restart computes it, and a preempted or resumed request needs
no generator state replayed. Unseeded rows draw ``u`` from torch's global generator.

Speculative decoding with a sampling draft model: ``meta.draft_distributions`` names the rows of
drafts drawn from a distribution ``q``; after sampling, those rows are verified by rejection
sampling against the rows' final distributions (``spec_decode.verify_drafts``) and rewritten to the
verified run before logprobs are gathered, so logprobs are the target's for the tokens emitted.
``sampling_probs`` is that final distribution (also the draft's ``q``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from gridserve.kernels.dispatch import one_thread
from gridserve.services.worker.spec_decode import DraftDistributions, verify_drafts
from gridserve.shared.scheduler_output import TokenLogprobs

_NEG_INF = float("-inf")


@dataclass
class Penalties:
    """Penalty inputs for the rows that use them."""

    rows: torch.Tensor  # [P] int64 row indices
    repetition: torch.Tensor  # [P] float32
    frequency: torch.Tensor  # [P] float32
    presence: torch.Tensor  # [P] float32
    output_counts: torch.Tensor  # [P, V] float32: occurrences of each token in the output so far
    seen: torch.Tensor  # [P, V] bool: token occurs in the prompt or the output


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
    uniforms: Optional[torch.Tensor]  # [B] float64 in (0, 1): each random row's draw this step
    banned_token_ids: dict[int, list[int]]  # row -> ids masked this step (bad words, min_tokens)
    max_num_logprobs: Optional[int]  # None when no row asked for logprobs
    num_logprobs: list[Optional[int]]
    allowed_token_ids: dict[int, list[int]] = field(default_factory=dict)
    logit_bias: dict[int, tuple[list[int], list[float]]] = field(default_factory=dict)
    penalties: Optional[Penalties] = None
    # speculative decoding: rows of drafts drawn from a distribution, verified by rejection sampling
    draft_distributions: Optional[DraftDistributions] = None


class Sampler:
    """Stateless batched sampler."""

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> tuple[torch.Tensor, list]:
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if meta.max_num_logprobs is not None else None
        logits = self.process_logits(logits, meta)
        if meta.all_greedy:
            sampled = greedy_argmax(logits)
        else:
            sampled = self._sample(logits, meta)
        logprobs = self._gather_logprobs(raw_logprobs, sampled, meta) if raw_logprobs is not None else []
        return sampled, logprobs

    @staticmethod
    def process_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Apply allowed ids, bans, logit bias and penalties (in place where possible)."""
        for row, ids in meta.allowed_token_ids.items():
            keep = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
            keep[ids] = True
            logits[row].masked_fill_(~keep, _NEG_INF)
        for row, ids in meta.banned_token_ids.items():
            logits[row, ids] = _NEG_INF
        for row, (ids, values) in meta.logit_bias.items():
            logits[row, ids] += torch.tensor(values, dtype=logits.dtype, device=logits.device)
        if meta.penalties is not None:
            logits[meta.penalties.rows] = apply_penalties(logits[meta.penalties.rows], meta.penalties)
        return logits

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Greedy rows take their argmax; only the random rows go through the full-vocabulary passes
        (temperature, min-p, top-k / top-p, softmax, CDF), each a row-wise operation. Rows of drafts
        drawn from a distribution are then verified against those rows' final distributions."""
        greedy = meta.temperature == 0
        if not bool(greedy.any()):
            rows = None
            probs = sampling_probs(logits, meta.temperature, meta.top_k, meta.top_p, meta.min_p,
                                   meta.need_top_k_top_p, meta.need_min_p)
            sampled = inverse_cdf_sample(probs, meta.uniforms)
        else:
            sampled = greedy_argmax(logits)
            rows = (~greedy).nonzero().squeeze(1)
            probs = sampling_probs(logits[rows], meta.temperature[rows], meta.top_k[rows], meta.top_p[rows],
                                   meta.min_p[rows], meta.need_top_k_top_p, meta.need_min_p)
            sampled[rows] = inverse_cdf_sample(probs, meta.uniforms[rows])
        if meta.draft_distributions:
            verify_drafts(sampled, probs, rows, meta.draft_distributions)
        return sampled

    @staticmethod
    def _gather_logprobs(logprobs: torch.Tensor, sampled: torch.Tensor, meta: SamplingMetadata) -> list:
        entries = gather_logprobs(logprobs, sampled, max(meta.max_num_logprobs, 1))
        return [None if n is None else trim_logprobs(e, n) for e, n in zip(entries, meta.num_logprobs)]


def sampling_probs(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   min_p: torch.Tensor, need_top_k_top_p: bool = True, need_min_p: bool = True) -> torch.Tensor:
    """The distribution each random row samples from: temperature, min-p, top-k / top-p, softmax."""
    logits = logits / temperature.unsqueeze(1)
    if need_min_p:
        probs = logits.softmax(dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
        logits = logits.masked_fill(probs < threshold, _NEG_INF)
    if need_top_k_top_p:
        logits = apply_top_k_top_p(logits, top_k, top_p)
    return logits.softmax(dim=-1)


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def counter_uniform(seed: int, index: int) -> float:
    """A uniform in (0, 1) that depends only on ``(seed, index)``: 53 bits of a SplitMix64 hash."""
    x = _splitmix64((seed & _MASK64) ^ _splitmix64(index & _MASK64))
    return ((x >> 11) + 0.5) / float(1 << 53)


_ARGMAX_CHUNK = 128


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` (the first maximal index, NaN counting as maximal), computed as the
    argmax of per-chunk maxima and then the argmax inside the winning chunk: ``amax`` is vectorized
    where torch's CPU ``argmax`` walks the row element by element (~6x slower over 32,000 columns)."""
    rows, vocab = logits.shape
    if vocab < 4 * _ARGMAX_CHUNK or logits.stride(-1) != 1 or logits.device.type != "cpu":
        return logits.argmax(dim=-1)
    with one_thread():  # a few MB: not worth an OpenMP region that may wait for a descheduled thread
        return _chunked_argmax(logits)


def _chunked_argmax(logits: torch.Tensor) -> torch.Tensor:
    rows, vocab = logits.shape
    k = _ARGMAX_CHUNK
    full = vocab // k
    chunk_max = logits.as_strided((rows, full, k), (logits.stride(0), k, 1)).amax(dim=-1)
    if full * k < vocab:  # the tail, a shorter last chunk
        chunk_max = torch.cat([chunk_max, logits[:, full * k :].amax(dim=-1, keepdim=True)], dim=1)
    start = chunk_max.argmax(dim=-1) * k  # the first chunk holding the row's maximum
    # the last chunk may be shorter: its window repeats column vocab - 1, after every real column
    window = (start.unsqueeze(1) + torch.arange(k, device=logits.device)).clamp_(max=vocab - 1)
    return start + logits.gather(1, window).argmax(dim=-1)


def inverse_cdf_sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative probability exceeds ``u`` (scaled by the row's
    total, so rounding in the sum cannot push ``u`` past the end). Tokens of probability zero are
    never chosen: their cumulative value equals their predecessor's."""
    cdf = probs.cumsum(dim=-1)
    total = cdf[:, -1:]
    # u close to 1 can round to the total in float32: keep the target strictly below it
    below_total = torch.nextafter(total, torch.zeros_like(total))
    target = torch.minimum(uniforms.to(cdf.dtype).unsqueeze(1) * total, below_total)
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)


def gather_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, k: int) -> list[TokenLogprobs]:
    """Per row: the chosen token's logprob and rank, then the top ``k`` candidates."""
    top_vals, top_ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1)
    ranks = (logprobs > chosen_lp.unsqueeze(1)).sum(dim=-1) + 1
    rows = zip(chosen.tolist(), chosen_lp.tolist(), ranks.tolist(), top_ids.tolist(), top_vals.tolist())
    return [TokenLogprobs([c, *ids], [lp, *vals], rank) for c, lp, rank, ids, vals in rows]


def trim_logprobs(entry: TokenLogprobs, n: int) -> TokenLogprobs:
    return TokenLogprobs(entry.token_ids[: n + 1], entry.logprobs[: n + 1], entry.sampled_rank)


def apply_penalties(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    """vLLM's penalties: repetition over prompt + output, frequency and presence over the output."""
    rep = p.repetition.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(p.seen, penalized, logits)
    logits = logits - p.frequency.unsqueeze(1) * p.output_counts
    return logits - p.presence.unsqueeze(1) * (p.output_counts > 0).to(logits.dtype)


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
