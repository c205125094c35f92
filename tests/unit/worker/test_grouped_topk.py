"""DeepSeek's router (``grouped_topk``) chooses the experts and weights a plain per-token reference
does: V2's softmax greedy and group-limited greedy, V3's sigmoid ``noaux_tc`` with a correction bias
and renormalisation, on random logits and on logits full of ties (lower index wins)."""

from __future__ import annotations

import math

import pytest
import torch

from gridserve.services.worker.fused_moe import grouped_topk


def _best(values: list[float], k: int) -> list[int]:
    """Indices of the ``k`` largest values, ties to the lower index."""
    return sorted(range(len(values)), key=lambda i: (-values[i], i))[:k]


def _reference(logits: torch.Tensor, top_k: int, scoring: str, n_group: int, topk_group: int, group_score: str,
               bias: list[float] | None, renormalize: bool, scaling: float) -> list[dict]:
    """Per token: ``{expert: weight}``, computed one token at a time in plain Python."""
    out = []
    for row in logits.tolist():
        if scoring == "softmax":
            peak = max(row)
            exps = [math.exp(x - peak) for x in row]
            scores = [e / sum(exps) for e in exps]
        else:
            scores = [1 / (1 + math.exp(-x)) for x in row]
        choice = [s + (bias[i] if bias else 0.0) for i, s in enumerate(scores)]
        size = len(row) // n_group
        groups = [choice[g * size : (g + 1) * size] for g in range(n_group)]
        group_values = [max(g) if group_score == "max" else sum(sorted(g, reverse=True)[:2]) for g in groups]
        allowed = {e for g in _best(group_values, topk_group) for e in range(g * size, (g + 1) * size)}
        masked = [c if i in allowed else -math.inf for i, c in enumerate(choice)]
        chosen = _best(masked, top_k)
        weights = {e: scores[e] for e in chosen}
        total = sum(weights.values()) + 1e-20
        out.append({e: (w / total if renormalize else w) * scaling for e, w in weights.items()})
    return out


CASES = {
    "v2_greedy": dict(scoring="softmax", n_group=1, topk_group=1, group_score="max"),
    "v2_group_limited": dict(scoring="softmax", n_group=4, topk_group=2, group_score="max"),
    "v3_noaux_tc": dict(scoring="sigmoid", n_group=4, topk_group=2, group_score="top2_sum"),
}


def _check(logits: torch.Tensor, top_k: int, case: dict, bias: torch.Tensor | None, renormalize: bool,
           scaling: float) -> None:
    weights, ids = grouped_topk(logits, top_k, correction_bias=bias, renormalize=renormalize,
                                scaling_factor=scaling, **case)
    assert weights.dtype == torch.float32 and weights.shape == ids.shape == (logits.shape[0], top_k)
    ref = _reference(logits, top_k, bias=None if bias is None else bias.tolist(), renormalize=renormalize,
                     scaling=scaling, **case)
    for t, expected in enumerate(ref):
        got = dict(zip(ids[t].tolist(), weights[t].tolist()))
        assert got.keys() == expected.keys(), (t, got, expected)
        assert all(abs(got[e] - expected[e]) < 1e-6 for e in got), (t, got, expected)


@pytest.mark.parametrize("name", list(CASES))
def test_router_matches_a_per_token_reference_on_random_logits(name):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 16, generator=gen) * 3
    bias = torch.rand(16, generator=gen) * 0.3 if name == "v3_noaux_tc" else None
    _check(logits, 3, CASES[name], bias, renormalize=name == "v3_noaux_tc", scaling=2.5)


@pytest.mark.parametrize("name", list(CASES))
def test_ties_go_to_the_lower_group_and_expert(name):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randint(0, 3, (64, 16), generator=gen).float()  # three distinct values: ties everywhere
    bias = torch.randint(0, 2, (16,), generator=gen).float() * 0.25 if name == "v3_noaux_tc" else None
    _check(logits, 4, CASES[name], bias, renormalize=True, scaling=1.0)


def test_all_equal_logits_choose_the_first_experts_of_the_first_groups():
    weights, ids = grouped_topk(torch.zeros(1, 8), 3, scoring="sigmoid", n_group=4, topk_group=2,
                                group_score="top2_sum", renormalize=True)
    assert sorted(ids[0].tolist()) == [0, 1, 2]
    assert torch.allclose(weights, torch.full((1, 3), 1 / 3))


def test_the_bias_steers_the_choice_but_not_the_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])
    weights, ids = grouped_topk(logits, 1, scoring="sigmoid", correction_bias=bias)
    assert ids.tolist() == [[3]] and weights.item() == pytest.approx(torch.sigmoid(torch.tensor(-1.0)).item())
