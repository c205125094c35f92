"""Speculative decoding's pieces in the worker (``services/worker/spec_decode.py``): n-gram
proposals, the accepted run of a verification, and the rejection sampler for draft distributions,
whose outputs must follow the target's distribution at every draft position (chi-square), alone and
inside the batched sampler (seeded draws, temperature / top-p, drafts far from the target); and the
runner's sampling metadata, which treats a draft row as plain decoding treats its position (its draw,
``min_tokens``, bad words and penalties counting the drafts before it)."""

from __future__ import annotations

import pytest
import torch

from gridserve.services.worker.model_runner import ModelRunner
from gridserve.services.worker.parallel_state import ParallelState, set_parallel_state
from gridserve.services.worker.sampler import (
    Sampler,
    SamplingMetadata,
    counter_uniform,
    inverse_cdf_sample,
    sampling_probs,
)
from gridserve.services.worker.spec_decode import (
    DraftDistributions,
    accepted_run,
    ngram_propose,
    rejection_sample,
)
from gridserve.shared.config import GridserveConfig
from gridserve.shared.sampling_params import SamplingParams
from gridserve.shared.scheduler_output import NewRequestData, SchedulerOutput

# chi-square critical values at p = 0.01: a sample that follows the distribution exceeds them 1% of the time
CHI2_CRITICAL_01 = {15: 30.578}
# ... and at p = 0.001 by degrees of freedom, for the sampler's test (18 checks: 0.01 each would be lax)
CHI2_CRITICAL_001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322, 8: 26.124,
                     9: 27.877, 10: 29.588, 11: 31.264, 12: 32.909, 13: 34.528, 14: 36.123, 15: 37.697}


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
    support = probs > 0
    expected = probs[support] * counts.sum()
    return float(((counts[support] - expected) ** 2 / expected).sum())


def _critical(probs: torch.Tensor) -> float:
    return CHI2_CRITICAL_001[int((probs > 0).sum()) - 1]


def _sample(target: torch.Tensor, draft: torch.Tensor, gen: torch.Generator) -> list[int]:
    """One verification of two drafts drawn from ``draft``: the tokens emitted (the bonus token
    drawn from ``target[2]`` when both are accepted)."""
    tokens = [int(torch.multinomial(draft[i], 1, generator=gen)) for i in range(2)]
    accept, resample = torch.rand(2, 2, generator=gen, dtype=torch.float64).tolist()
    accepted, token = rejection_sample(target[:2], draft, tokens, accept, resample)
    if token is None:
        token = int(torch.multinomial(target[2], 1, generator=gen))
    return tokens[:accepted] + [token]


def test_rejection_sampling_keeps_the_target_distribution_at_every_draft_position():
    vocab, draws = 16, 20_000
    gen = torch.Generator().manual_seed(0)
    # two positions with different, skewed targets, and drafts from distributions far from them
    target = torch.softmax(torch.randn(3, vocab, generator=gen), -1)
    draft = torch.softmax(torch.randn(2, vocab, generator=gen) * 2.0, -1)
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)
    for _ in range(draws):
        out = _sample(target, draft, gen)
        first[out[0]] += 1
        if len(out) > 1:  # position 0 accepted: position 1 is drawn given it
            second[out[1]] += 1
    assert second.sum() > 2_500
    assert _chi_square(first, target[0]) < CHI2_CRITICAL_01[vocab - 1]
    assert _chi_square(second, target[1]) < CHI2_CRITICAL_01[vocab - 1]
    # and the draft's distribution would fail the same test: the check has power
    assert _chi_square(first, draft[0]) > CHI2_CRITICAL_01[vocab - 1]


def test_a_draft_equal_to_the_target_is_always_accepted():
    probs = torch.softmax(torch.randn(3, 8), -1)
    for token in range(8):
        assert rejection_sample(probs[:2], probs[:2], [token, token], [0.999, 0.999], [0.5, 0.5]) == (2, None)


def test_a_rejected_draft_is_replaced_by_another_token():
    target = torch.tensor([[0.5, 0.5, 0.0, 0.0]])
    draft = torch.tensor([[0.0, 0.0, 1.0, 0.0]])  # a token the target never emits: always rejected
    for u in (0.01, 0.5, 0.99):
        accepted, token = rejection_sample(target, draft, [2], [u], [u])
        assert accepted == 0 and token in (0, 1)


# ---- inside the batched sampler: seeded draws, processed distributions ----------------------------

VOCAB = 16
REQUESTS = 20_000
K = 2


def _batch_meta(logits: torch.Tensor, seeds: range, temperature: float, top_p: float) -> SamplingMetadata:
    rows = logits.shape[0]
    offsets = list(range(K + 1)) * len(seeds)
    uniforms = [counter_uniform(seed, offset) for seed in seeds for offset in range(K + 1)]
    return SamplingMetadata(
        temperature=torch.full((rows,), temperature), top_p=torch.full((rows,), top_p),
        top_k=torch.full((rows,), VOCAB, dtype=torch.int64), min_p=torch.zeros(rows), all_greedy=False,
        need_top_k_top_p=top_p < 1, need_min_p=False, uniforms=torch.tensor(uniforms, dtype=torch.float64),
        banned_token_ids={}, max_num_logprobs=None, num_logprobs=[None] * len(offsets),
    )


DRAFT_STREAM, ACCEPT_STREAM, RESAMPLE_STREAM = 1, 2, 3


def stream_uniform(seed: int, stream: int, index: int) -> float:
    """Counter-based uniforms of ``(seed, stream, index)``, apart from the sampler's own
    ``counter_uniform(seed, index)``: reproducible draws for the draft and the verification."""
    return counter_uniform((1 << 62) + 4 * seed + stream, index)


def _seeded_drafts(q: torch.Tensor, seeds: range) -> DraftDistributions:
    """Each request's ``K`` drafts drawn from ``q`` with reproducible draws, as the draft model draws."""
    drafts = DraftDistributions()
    for n, seed in enumerate(seeds):
        u = torch.tensor([stream_uniform(seed, DRAFT_STREAM, j) for j in range(K)], dtype=torch.float64)
        tokens = inverse_cdf_sample(q, u).tolist()
        drafts.add(n * (K + 1), tokens, q,
                   [stream_uniform(seed, ACCEPT_STREAM, j) for j in range(K)],
                   [stream_uniform(seed, RESAMPLE_STREAM, j) for j in range(K)])
    return drafts


def _verified_runs(target_logits: torch.Tensor, q: torch.Tensor, temperature: float, top_p: float) -> list:
    runs = []
    for start in range(0, REQUESTS, 5_000):
        seeds = range(start, start + 5_000)
        logits = target_logits.repeat(len(seeds), 1)
        meta = _batch_meta(logits, seeds, temperature, top_p)
        meta.draft_distributions = _seeded_drafts(q, seeds)
        tokens = Sampler()(logits, meta)[0].view(len(seeds), K + 1).tolist()
        runs += [accepted_run(row, drafts) for row, drafts in zip(tokens, meta.draft_distributions.tokens)]
    return runs


def _far_drafts(p: torch.Tensor) -> dict[str, torch.Tensor]:
    """Draft distributions unlike the target ``p`` ([K, V]): skewed at random, a point mass on the
    target's least likely token, and mass mostly where the target has none."""
    gen = torch.Generator().manual_seed(5)
    point = torch.zeros(K, VOCAB)
    point[torch.arange(K), p.argmin(-1)] = 1.0
    outside = (p == 0).float() * 10 + 0.1
    return {"skewed": torch.softmax(torch.randn(K, VOCAB, generator=gen) * 3.0, -1), "point-mass": point,
            "off-support": outside / outside.sum(-1, keepdim=True)}


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.8)])
def test_seeded_draft_verification_in_the_sampler_follows_the_target_whatever_the_draft(temperature, top_p):
    """Every draft position's emitted token follows the target's processed distribution ``p``
    (temperature, top-p), whatever the draft distribution, with the seeded counter-based draws."""
    target_logits = torch.randn(K + 1, VOCAB, generator=torch.Generator().manual_seed(3)) * 1.5
    p = sampling_probs(target_logits, torch.full((K + 1,), temperature), torch.full((K + 1,), VOCAB),
                       torch.full((K + 1,), top_p), torch.zeros(K + 1))
    for name, q in _far_drafts(p[:K]).items():
        runs = _verified_runs(target_logits, q, temperature, top_p)
        tested = []
        for position in range(K + 1):  # position i is emitted when the drafts before it were accepted
            counts = torch.bincount(torch.tensor([r[position] for r in runs if len(r) > position], dtype=torch.int64),
                                    minlength=VOCAB).double()
            if counts.sum() < 1_000:
                continue  # a draft far from p seldom passes: too few later positions to test
            assert counts[p[position] == 0].sum() == 0, (name, position, "a token outside p")
            assert _chi_square(counts, p[position]) < _critical(p[position]), (name, position)
            tested.append(position)
        # the first position always; the second too where drafts pass often (the skewed draft)
        assert tested[:1] == [0] and (1 in tested or name != "skewed"), (name, tested)
        if name == "skewed":  # the test has power: the draft's own distribution fails it
            first = torch.bincount(torch.tensor([r[0] for r in runs]), minlength=VOCAB).double()
            assert _chi_square(first, q[0] + 1e-9) > _critical(q[0])


def test_draft_verification_is_a_function_of_its_draws_whatever_the_batch():
    target_logits = torch.randn(K + 1, VOCAB, generator=torch.Generator().manual_seed(4))
    q = torch.softmax(torch.randn(K, VOCAB, generator=torch.Generator().manual_seed(6)), -1)

    def runs(seeds: range) -> list:
        logits = target_logits.repeat(len(seeds), 1)
        meta = _batch_meta(logits, seeds, 1.0, 1.0)
        meta.draft_distributions = _seeded_drafts(q, seeds)
        tokens = Sampler()(logits, meta)[0].view(len(seeds), K + 1).tolist()
        return [accepted_run(row, d) for row, d in zip(tokens, meta.draft_distributions.tokens)]

    together = runs(range(100, 164))
    assert together == runs(range(100, 164))
    assert [runs(range(s, s + 1))[0] for s in range(100, 164)] == together
    assert len({tuple(r) for r in together}) > 10  # the seeds matter


# ---- the runner's metadata: a draft row is sampled as plain decoding samples its position ---------


def test_a_draft_row_is_penalised_and_banned_as_plain_decoding_would_be_at_its_position(llama_tiny):
    """A request with drafts and, for each draft offset ``j``, the same request with ``drafts[:j]``
    already in its output: row ``j``'s processed logits and draw equal the latter's."""
    set_parallel_state(ParallelState.single())
    config = GridserveConfig.from_kwargs(model=str(llama_tiny), device="cpu").finalize()
    runner = ModelRunner(config, torch.device("cpu"))
    prompt, output, drafts = [5, 6, 7, 8], [9, 10, 9], [10, 12, 9, 10]
    params = SamplingParams(temperature=0.8, seed=7, repetition_penalty=1.3, frequency_penalty=0.5,
                            presence_penalty=0.4, min_tokens=6, stop_token_ids=[30])
    # banned after "9 10" (rows 1 and 4: their outputs end with drafts), after 12 (row 2), always
    params.bad_words_token_ids = [[9, 10, 20], [12, 21], [22]]
    new = [NewRequestData("spec", prompt, params, [1], 0, output_token_ids=output)]
    new += [NewRequestData(f"plain{j}", prompt, params, [1], 0, output_token_ids=output + drafts[:j])
            for j in range(len(drafts) + 1)]
    runner._update_states(SchedulerOutput(scheduled_new_reqs=new))
    vocab, rows = config.model.vocab_size, len(drafts) + 1
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(8)).repeat(rows, 1)
    logits[:, [9, 10, 11, 12, 20, 21, 22, 30]] += 3.0  # the tokens that matter, positive and negative
    logits[:, [5, 6, 7]] -= 6.0
    meta = runner._sampling_metadata(["spec"] * rows, vocab, list(range(rows)), {"spec": drafts})
    got = Sampler.process_logits(logits.clone(), meta)
    for j in range(rows):
        plain = runner._sampling_metadata([f"plain{j}"], vocab)
        assert torch.equal(got[j], Sampler.process_logits(logits[j:j + 1].clone(), plain)[0]), j
        assert meta.uniforms[j] == plain.uniforms[0]
        assert sorted(meta.banned_token_ids.get(j, [])) == sorted(plain.banned_token_ids.get(0, [])), j
    assert [20 in meta.banned_token_ids[j] for j in range(rows)] == [False, True, False, False, True]
    assert [21 in meta.banned_token_ids[j] for j in range(rows)] == [False, False, True, False, False]
    assert [30 in meta.banned_token_ids[j] for j in range(rows)] == [True, True, True, False, False]
    assert all(not torch.equal(got[j], got[j + 1]) for j in range(rows - 1))  # each draft counts
