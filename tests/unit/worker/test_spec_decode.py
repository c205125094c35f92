"""Speculative decoding's pieces in the worker (``services/worker/spec_decode.py``): n-gram
proposals, the accepted run of a verification, and the rejection sampler for draft distributions,
whose outputs must follow the target's distribution at every draft position (chi-square)."""

from __future__ import annotations

import pytest
import torch

from gridserve.services.worker.spec_decode import accepted_run, ngram_propose, rejection_sample

# chi-square critical values at p = 0.01: a sample that follows the distribution exceeds them 1% of the time
CHI2_CRITICAL_01 = {15: 30.578}


def test_ngram_proposes_what_followed_the_most_recent_earlier_match_longest_first():
    tokens = [1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 7, 2, 3, 4]
    # "2 3 4" occurred twice before; the most recent (followed by 6 7 2) wins
    assert ngram_propose(tokens, 3, 2, 3) == [6, 7, 2]
    assert ngram_propose(tokens, 10, 2, 3) == [6, 7, 2, 3, 4]  # up to the end of the sequence
    # only the longer n-gram distinguishes: "9 2 3 4" occurs once, followed by 6
    assert ngram_propose([9, 2, 3, 4, 6, 1, 2, 3, 4, 8, 9, 2, 3, 4], 1, 2, 4) == [6]


def test_ngram_proposes_nothing_without_a_match_or_room():
    assert ngram_propose([1, 2, 3, 4, 5], 3, 2, 3) == []
    assert ngram_propose([1, 1], 3, 2, 3) == []  # too short to hold a match and its follower
    assert ngram_propose([7, 7, 7], 2, 1, 1) == [7]
    assert ngram_propose([1, 2, 1, 2], 0, 1, 2) == []


def test_the_accepted_run_ends_at_the_first_sample_that_differs_from_its_draft():
    assert accepted_run([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all accepted, plus the bonus
    assert accepted_run([5, 9, 7, 8], [5, 6, 7]) == [5, 9]  # draft 1 rejected: the target's 9 instead
    assert accepted_run([4, 6, 7, 8], [5, 6, 7]) == [4]
    with pytest.raises(ValueError, match="drafts \\+ 1"):
        accepted_run([1, 2], [1, 2])


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_rejection_sampling_keeps_the_target_distribution_at_every_draft_position():
    vocab, draws = 16, 20_000
    gen = torch.Generator().manual_seed(0)
    # two positions with different, skewed targets, and drafts from distributions far from them
    target = torch.softmax(torch.randn(3, vocab, generator=gen), -1)
    draft = torch.softmax(torch.randn(2, vocab, generator=gen) * 2.0, -1)
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)
    num_second = 0
    for _ in range(draws):
        tokens = [int(torch.multinomial(draft[i], 1, generator=gen)) for i in range(2)]
        uniforms = torch.rand(4, generator=gen, dtype=torch.float64)
        out = rejection_sample(target, draft, tokens, uniforms, float(torch.rand(1, generator=gen)))
        first[out[0]] += 1
        if len(out) > 1:  # position 0 accepted: position 1 is drawn given it
            second[out[1]] += 1
            num_second += 1
    assert num_second > 2_500
    assert _chi_square(first, target[0]) < CHI2_CRITICAL_01[vocab - 1]
    assert _chi_square(second, target[1]) < CHI2_CRITICAL_01[vocab - 1]
    # and the draft's distribution would fail the same test: the check has power
    assert _chi_square(first, draft[0]) > CHI2_CRITICAL_01[vocab - 1]


def test_a_draft_equal_to_the_target_is_always_accepted():
    probs = torch.softmax(torch.randn(3, 8), -1)
    for token in range(8):
        out = rejection_sample(probs, probs[:2], [token, token], torch.full((4,), 0.999, dtype=torch.float64), 0.5)
        assert out[:2] == [token, token] and len(out) == 3
