"""The batched sampler draws exactly from the processed distribution, with vLLM's formulas."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from gridserve.services.worker.sampler import (  # noqa: E402
    Penalties,
    Sampler,
    SamplingMetadata,
    apply_penalties,
    counter_uniform,
    inverse_cdf_sample,
)

LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0])
DRAWS = 40_000
# chi-square critical values at p = 0.001 by degrees of freedom
CHI2_CRITICAL = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


def _meta(rows: int, *, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, **extra) -> SamplingMetadata:
    vocab = LOGITS.numel()
    return SamplingMetadata(
        temperature=torch.full((rows,), temperature),
        top_p=torch.full((rows,), top_p),
        top_k=torch.full((rows,), top_k if top_k else vocab, dtype=torch.int64),
        min_p=torch.full((rows,), min_p),
        all_greedy=temperature == 0,
        need_top_k_top_p=top_p < 1 or bool(top_k),
        need_min_p=min_p > 0,
        uniforms=extra.pop("uniforms", torch.rand(rows, dtype=torch.float64,
                                                   generator=torch.Generator().manual_seed(1234))),
        banned_token_ids=extra.pop("banned", {}),
        max_num_logprobs=None,
        num_logprobs=[None] * rows,
        **extra,
    )


def _expected(temperature=1.0, keep=None) -> torch.Tensor:
    probs = torch.softmax(LOGITS / temperature, -1)
    if keep is not None:
        mask = torch.zeros_like(probs, dtype=torch.bool)
        mask[keep] = True
        probs = torch.where(mask, probs, torch.zeros_like(probs))
    return probs / probs.sum()


def _draw(meta: SamplingMetadata) -> torch.Tensor:
    torch.manual_seed(1234)
    sampled, _ = Sampler()(LOGITS.repeat(DRAWS, 1), meta)
    return torch.bincount(sampled, minlength=LOGITS.numel()).double()


def _assert_distribution(counts: torch.Tensor, expected: torch.Tensor) -> None:
    support = expected > 0
    assert counts[~support].sum() == 0, "a masked token was sampled"
    exp = expected[support].double() * DRAWS
    chi2 = float(((counts[support] - exp) ** 2 / exp).sum())
    dof = int(support.sum()) - 1
    if dof:
        assert chi2 < CHI2_CRITICAL[dof], f"chi2={chi2:.2f} with {dof} dof"


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_samples_the_tempered_softmax(temperature):
    _assert_distribution(_draw(_meta(DRAWS, temperature=temperature)), _expected(temperature))


def test_top_k_samples_the_renormalised_top_k():
    _assert_distribution(_draw(_meta(DRAWS, top_k=3)), _expected(keep=[0, 1, 2]))


def test_top_p_keeps_the_smallest_nucleus_reaching_p():
    probs = _expected()
    cumulative = probs.cumsum(0)
    p = float(cumulative[2]) - 1e-3  # needs exactly the top 3 tokens
    _assert_distribution(_draw(_meta(DRAWS, top_p=p)), _expected(keep=[0, 1, 2]))


def test_min_p_drops_tokens_below_fraction_of_the_top_probability():
    probs = _expected()
    min_p = 0.3
    keep = [i for i in range(LOGITS.numel()) if probs[i] >= min_p * probs[0]]
    _assert_distribution(_draw(_meta(DRAWS, min_p=min_p)), _expected(keep=keep))


def test_greedy_takes_the_argmax_and_banned_ids_are_never_sampled():
    sampled, _ = Sampler()(LOGITS.repeat(4, 1), _meta(4, temperature=0.0, banned={1: [0], 3: [0, 1]}))
    assert sampled.tolist() == [0, 1, 0, 2]


def test_allowed_token_ids_restrict_the_distribution():
    meta = _meta(DRAWS, allowed_token_ids={row: [3, 5] for row in range(DRAWS)})
    _assert_distribution(_draw(meta), _expected(keep=[3, 5]))


def test_logit_bias_adds_exactly_the_bias():
    meta = _meta(2, logit_bias={0: ([4, 7], [1.5, -2.0])})
    out = Sampler.process_logits(LOGITS.repeat(2, 1), meta)
    expected = LOGITS.clone()
    expected[4] += 1.5
    expected[7] -= 2.0
    assert torch.equal(out[0], expected) and torch.equal(out[1], LOGITS)


def test_penalties_follow_vllm_formulas():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 1.0]])
    counts = torch.tensor([[3.0, 1.0, 0.0, 0.0, 0.0]])  # output: token 0 thrice, token 1 once
    seen = torch.tensor([[True, True, False, True, False]])  # token 3 appears in the prompt only
    p = Penalties(torch.tensor([0]), torch.tensor([1.5]), torch.tensor([0.25]), torch.tensor([0.5]), counts, seen)
    out = apply_penalties(logits.clone(), p)
    reference = [
        2.0 / 1.5 - 0.25 * 3 - 0.5,  # positive, seen: divided; then frequency and presence
        -1.0 * 1.5 - 0.25 * 1 - 0.5,  # negative, seen: multiplied
        0.5,  # untouched
        -0.5 * 1.5,  # prompt-only token: repetition penalty only
        1.0,
    ]
    assert out[0].tolist() == pytest.approx(reference)


def test_counter_uniform_is_a_pure_function_of_seed_and_index():
    draws = [counter_uniform(7, i) for i in range(20000)]
    assert draws[:50] == [counter_uniform(7, i) for i in range(50)]  # same inputs, same value
    assert all(0.0 < u < 1.0 for u in draws)
    assert len(set(draws)) == len(draws)
    assert counter_uniform(8, 0) != counter_uniform(7, 0) and counter_uniform(2**64 + 7, 3) == counter_uniform(7, 3)
    # uniform: mean 1/2, variance 1/12, and each tenth of (0, 1) holds ~10%
    mean = sum(draws) / len(draws)
    assert abs(mean - 0.5) < 0.01
    assert abs(sum((u - mean) ** 2 for u in draws) / len(draws) - 1 / 12) < 0.005
    deciles = torch.histc(torch.tensor(draws), bins=10, min=0.0, max=1.0) / len(draws)
    assert float((deciles - 0.1).abs().max()) < 0.01


def test_inverse_cdf_never_picks_a_zero_probability_token_even_at_the_edges():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 4)
    u = torch.tensor([2.0**-53, 0.49, 0.51, 1 - 2.0**-53], dtype=torch.float64)
    assert inverse_cdf_sample(probs, u).tolist() == [1, 1, 3, 3]


def test_seeded_rows_draw_the_same_token_in_any_batch():
    # the same logits row, seeded, placed among different neighbours: the same token each time
    row = torch.randn(1, 50, generator=torch.Generator().manual_seed(3))
    u = torch.tensor([counter_uniform(11, 4)], dtype=torch.float64)
    alone, _ = Sampler()(row.clone(), _meta(1, uniforms=u))
    for batch in (3, 17):
        logits = torch.randn(batch, 50)
        logits[batch // 2] = row
        uniforms = torch.rand(batch, dtype=torch.float64)
        uniforms[batch // 2] = u
        sampled, _ = Sampler()(logits, _meta(batch, uniforms=uniforms))
        assert sampled[batch // 2] == alone[0]


# ---- the fast paths give the same tokens as the full-vocabulary passes ------------------------------
@pytest.mark.parametrize("vocab", [7, 511, 512, 32000, 32003])
def test_greedy_argmax_is_torch_argmax_with_ties_nan_and_masked_rows(vocab):
    from gridserve.services.worker.sampler import greedy_argmax

    logits = torch.randn(9, vocab, generator=torch.Generator().manual_seed(vocab))
    logits[1, vocab // 3] = logits[1, vocab - 1] = 50.0  # a tie: the first index wins
    logits[2] = float("-inf")  # every token banned
    logits[3, vocab // 2] = float("nan")  # NaN counts as the maximum
    logits[4, -1] = 60.0  # the maximum in the (possibly short) last chunk
    logits[5] = 0.0  # all equal
    logits[6, 0] = -0.0
    logits[6, 1:] = -1.0
    assert torch.equal(greedy_argmax(logits), logits.argmax(dim=-1))
    wide = torch.randn(4, 2 * vocab)[:, ::2]  # not contiguous: torch's own argmax
    assert torch.equal(greedy_argmax(wide), wide.argmax(dim=-1))


def _old_sample(logits, meta):
    """The sampler's formula before greedy rows left the full-vocabulary passes: whole batch, greedy
    rows at temperature 1, then ``where``."""
    from gridserve.services.worker.sampler import apply_top_k_top_p

    greedy = meta.temperature == 0
    greedy_tokens = logits.argmax(dim=-1)
    logits = logits / torch.where(greedy, torch.ones_like(meta.temperature), meta.temperature).unsqueeze(1)
    if meta.need_min_p:
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < probs.amax(dim=-1, keepdim=True) * meta.min_p.unsqueeze(1),
                                    float("-inf"))
    if meta.need_top_k_top_p:
        logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
    return torch.where(greedy, greedy_tokens, inverse_cdf_sample(logits.softmax(dim=-1), meta.uniforms))


@pytest.mark.parametrize("greedy_rows", [[], [0], [1, 4, 5], list(range(7))])
def test_mixed_batches_sample_exactly_as_the_whole_batch_formula(greedy_rows):
    gen = torch.Generator().manual_seed(7)
    rows, vocab = 8, 1000
    logits = torch.randn(rows, vocab, generator=gen) * 3
    meta = _meta(rows, uniforms=torch.rand(rows, dtype=torch.float64, generator=gen))
    meta.temperature = torch.rand(rows, generator=gen) + 0.5
    meta.temperature[greedy_rows] = 0.0
    meta.top_p = torch.rand(rows, generator=gen) * 0.5 + 0.5
    meta.top_k = torch.randint(1, vocab + 1, (rows,), generator=gen)
    meta.min_p = torch.rand(rows, generator=gen) * 0.1
    meta.need_top_k_top_p = meta.need_min_p = True
    sampled, _ = Sampler()(logits.clone(), meta)
    assert torch.equal(sampled, _old_sample(logits.clone(), meta))
