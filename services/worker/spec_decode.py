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

``rejection_sample`` is the general rule for a draft *distribution* ``q`` (a draft model's or an
EAGLE / MTP head's proposals plug in here: they bring ``q`` with their tokens), tested for
following ``p`` in ``tests/unit/worker/test_spec_decode.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

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


def rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: Sequence[int],
                     uniforms: torch.Tensor, bonus_uniform: float) -> list[int]:
    """Leviathan et al.'s rule for drafts drawn from a distribution ``q``: accept draft ``i`` with
    probability ``min(1, p_i(d) / q_i(d))``; at the first rejection draw from ``max(0, p_i - q_i)``
    normalised and stop; with every draft accepted, draw the bonus token from ``p_k``.

    ``target_probs``: [k + 1, V] (the target at each draft position and after the last);
    ``draft_probs``: [k, V]; ``uniforms``: [2k] (an acceptance draw and a resampling draw per
    position); ``bonus_uniform``: the bonus token's draw. The output follows ``p`` at every position.
    """
    k = len(draft_tokens)
    out: list[int] = []
    for i, token in enumerate(draft_tokens):
        p, q = target_probs[i], draft_probs[i]
        if float(uniforms[2 * i]) * float(q[token]) <= float(p[token]):  # u < p/q, without dividing by 0
            out.append(int(token))
            continue
        residual = (p - q).clamp_(min=0)
        total = float(residual.sum())
        out.append(_inverse_cdf(residual / total if total > 0 else p, float(uniforms[2 * i + 1])))
        return out
    out.append(_inverse_cdf(target_probs[k], bonus_uniform))
    return out


def _inverse_cdf(probs: torch.Tensor, u: float) -> int:
    """The token whose cumulative probability first exceeds ``u``."""
    cdf = torch.cumsum(probs.double(), 0)
    return int(min(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64)).item(),
                   probs.shape[0] - 1))
