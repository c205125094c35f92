"""Speculative decoding in the worker: n-gram proposals and the verification of drafts.

**Proposing (prompt lookup).** After a request's tokens grow, look for its last ``n`` tokens
(``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``) earlier in the sequence; the most
recent earlier match proposes the (up to) ``k`` tokens that followed it. Code edits, extraction and
chat that quotes its context repeat text the prompt holds, so these drafts are often right.

**Verifying.** The next step runs the request's last token and its ``k`` drafts through the target
in one pass and samples the target at every one of the ``k + 1`` positions, each position with the
draw it would have had without speculation (``counter_uniform(seed, output index)`` for a seeded
request). Drafts are accepted while the target's sample equals them; the first sample that differs,
or the sample after the last draft, ends the run. An n-gram draft is a point mass ``q = 1{d}``, for
which this *is* Leviathan et al.'s rejection sampling: accept with probability ``min(1, p(d) / q(d))
= p(d)``, and on rejection draw from ``(p - q)+`` normalised, i.e. ``p`` without ``d`` — exactly
"draw from ``p``, accept iff the draw is ``d``". Every emitted token is the target's own sample at
its position, so greedy and seeded outputs equal decoding without speculation.

**Drafts from a distribution.** A draft model samples the proposals of a request that samples
(``draft_model.py``): draft ``d_i`` drawn from the draft's own distribution ``q_i``, which travels
with it (worker-local: the driver that proposes also verifies) as a ``DraftDistributions`` entry
of the step's sampling metadata. The sampler then verifies those rows by Leviathan et al.'s rule
(``rejection_sample``): accept ``d_i`` with probability ``min(1, p_i(d_i) / q_i(d_i))``; at the
first rejection draw from ``max(0, p_i - q_i)`` normalised and stop; with every draft accepted the
bonus token is the target's own sample after the last draft. ``p_i`` is the target's final
distribution at row ``i`` (temperature, top-k / top-p / min-p, bans, penalties, grammar; those
that depend on the tokens before it count the drafts before it), so each emitted token
follows it whatever ``q`` is (``tests/unit/worker/test_spec_decode.py``). ``verify_drafts``
rewrites the rows to the verified run (accepted drafts, then the drawn token, which differs from the
draft it replaces: ``p - q`` is 0 there), so ``accepted_run`` gives the same run on every rank.

Only unseeded requests get sampled drafts (their draws are fresh uniforms). Greedy, seeded and
structured-output requests (the latter's drafts are cut at the grammar's first refusal, which would
bias the rule) keep point-mass drafts and the exact-match verification above: a seeded request's
tokens are then exactly those of decoding without speculation, at any batch size. EAGLE / MTP heads would plug
in as a draft model does: tokens plus ``q`` per position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch


def ngram_propose(tokens: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to ``k`` tokens that followed the most recent earlier occurrence of the sequence's last
    ``n`` tokens, trying ``n = max_n .. min_n``; empty when none occurs."""
    length = len(tokens)
    if k < 1 or length < min_n + 1:
        return []
    array = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = array[length - n:]
        # every window of n tokens that ends before the last token (a match must have a follower)
        windows = np.lib.stride_tricks.sliding_window_view(array[:length - 1], n)
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return array[start:start + k].tolist()
    return []


def accepted_run(samples: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """The tokens a request gets from verifying ``drafts``: ``samples[i]`` is the target's sample
    at draft position ``i`` (``len(drafts) + 1`` of them). Drafts are accepted while they equal the
    sample; the run ends with the first sample that differs, or the one after the last draft."""
    if len(samples) != len(drafts) + 1:
        raise ValueError(f"{len(samples)} samples for {len(drafts)} drafts (need drafts + 1)")
    accepted = 0
    while accepted < len(drafts) and samples[accepted] == drafts[accepted]:
        accepted += 1
    return list(samples[:accepted + 1])


@dataclass
class DraftDistributions:
    """A step's drafts drawn from a distribution, one entry per request: its first sampled row
    (its ``k + 1`` rows follow), drafts, ``q`` ([k, V]) and the acceptance and residual draws."""

    first_rows: list[int] = field(default_factory=list)
    tokens: list[list[int]] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)
    accept_uniforms: list[list[float]] = field(default_factory=list)
    resample_uniforms: list[list[float]] = field(default_factory=list)

    def add(self, first_row: int, tokens: list[int], probs: torch.Tensor, accept_uniforms: list[float],
            resample_uniforms: list[float]) -> None:
        self.first_rows.append(first_row)
        self.tokens.append(tokens)
        self.probs.append(probs)
        self.accept_uniforms.append(accept_uniforms)
        self.resample_uniforms.append(resample_uniforms)

    def __len__(self) -> int:
        return len(self.first_rows)


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: Sequence[int],
                     accept_uniforms: Sequence[float], resample_uniforms: Sequence[float]) -> tuple[int, Optional[int]]:
    """Leviathan et al.'s rule for drafts drawn from ``q``: accept draft ``i`` with probability
    ``min(1, p_i(d) / q_i(d))``; at the first rejection draw from ``max(0, p_i - q_i)`` normalised.

    ``target_probs`` / ``draft_probs``: [k, V] (``q`` may be narrower: padded with zeros); one
    acceptance and one residual draw per position. Returns the number of drafts accepted and the
    token drawn at the first rejection (``None`` when all were accepted: the caller's bonus token,
    drawn from ``p_k``, follows). Every position's output follows ``p_i``.
    """
    k = len(draft_tokens)
    if k == 0:
        return 0, None
    p = target_probs[:k].double()
    q = draft_probs[:k].to(p.device, torch.float64)
    if q.shape[-1] < p.shape[-1]:
        q = torch.nn.functional.pad(q, (0, p.shape[-1] - q.shape[-1]))
    index = torch.tensor(list(draft_tokens), dtype=torch.int64, device=p.device).unsqueeze(1)
    p_d, q_d = p.gather(1, index).squeeze(1), q.gather(1, index).squeeze(1)
    # u < p / q without dividing by 0 (q(d) > 0: d was drawn from q)
    accept = (torch.tensor(list(accept_uniforms[:k]), dtype=torch.float64, device=p.device) * q_d <= p_d).tolist()
    if all(accept):
        return k, None
    i = accept.index(False)
    residual = (p[i] - q[i]).clamp_(min=0)
    residual[int(draft_tokens[i])] = 0.0  # already 0 (p(d) < q(d)); exact whatever the rounding
    total = float(residual.sum())
    return i, _inverse_cdf(residual if total > 0 else p[i], float(resample_uniforms[i]))


def verify_drafts(sampled: torch.Tensor, probs: torch.Tensor, prob_rows: Optional[torch.Tensor],
                  drafts: DraftDistributions) -> None:
    """Rewrite, in place, each drafted request's sampled rows to its verified run: accepted drafts,
    then the token drawn at the rejection (or the sampled bonus row, untouched). ``probs``: the
    target's final distribution of the random rows, ``prob_rows`` their batch rows (``None``: every
    row, in order)."""
    position = None
    if prob_rows is not None:
        position = {row: i for i, row in enumerate(prob_rows.tolist())}
    for first, tokens, q, accept_u, resample_u in zip(drafts.first_rows, drafts.tokens, drafts.probs,
                                                      drafts.accept_uniforms, drafts.resample_uniforms):
        start = first if position is None else position[first]
        accepted, token = rejection_sample(probs[start:start + len(tokens)], q, tokens, accept_u, resample_u)
        if accepted:
            sampled[first:first + accepted] = torch.tensor(tokens[:accepted], dtype=sampled.dtype)
        if token is not None:
            sampled[first + accepted] = token


def _inverse_cdf(probs: torch.Tensor, u: float) -> int:
    """The token whose cumulative probability first reaches ``u`` of the total (never one of
    probability 0)."""
    cdf = torch.cumsum(probs.double(), 0)
    target = torch.tensor([u * float(cdf[-1])], dtype=torch.float64, device=cdf.device)
    return int(min(torch.searchsorted(cdf, target).item(),
                   probs.shape[0] - 1))
