"""Mixtral's router and its experts (the fused MoE layer) against direct per-token torch computations."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

from gridserve.services.worker.fused_moe import FusedMoE  # noqa: E402
from gridserve.services.worker.models.mixtral import route  # noqa: E402
from gridserve.services.worker.parallel_state import ParallelState  # noqa: E402
from gridserve.shared.parallel import RankLayout  # noqa: E402

HF = SimpleNamespace(hidden_size=16, intermediate_size=24, num_local_experts=5, num_experts_per_tok=2)


def _experts(rank: int = 0, tp: int = 1) -> FusedMoE:
    return FusedMoE(HF.num_local_experts, HF.hidden_size, HF.intermediate_size, ParallelState(RankLayout(rank, tp, 1)))


def _full_weights(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    e, i, h = HF.num_local_experts, HF.intermediate_size, HF.hidden_size
    w1, w3 = torch.randn(e, i, h, generator=g) / h**0.5, torch.randn(e, i, h, generator=g) / h**0.5
    return w1, w3, torch.randn(e, h, i, generator=g) / i**0.5


def _fill(experts: FusedMoE, w1, w3, w2) -> FusedMoE:
    s = experts.shard
    experts.gate_up_proj.data.copy_(torch.cat([w1[:, s.start : s.end], w3[:, s.start : s.end]], dim=1))
    experts.down_proj.data.copy_(w2[:, :, s.start : s.end])
    return experts


def test_route_keeps_the_top_k_softmax_probabilities_renormalised_to_one():
    logits = torch.randn(64, HF.num_local_experts, generator=torch.Generator().manual_seed(1))
    weights, ids = route(logits, 2)
    probs = torch.softmax(logits.double(), dim=-1)
    for t in range(logits.shape[0]):
        ranked = sorted(range(HF.num_local_experts), key=lambda e: -probs[t, e].item())[:2]
        assert ids[t].tolist() == ranked
        kept = probs[t, ranked]
        assert torch.allclose(weights[t].double(), kept / kept.sum(), atol=1e-6)
    assert torch.allclose(weights.sum(-1), torch.ones(64))


def test_route_computes_in_fp32_for_half_precision_logits():
    logits = torch.randn(8, HF.num_local_experts).to(torch.bfloat16)
    weights, ids = route(logits, 3)
    assert weights.dtype == torch.float32 and ids.shape == (8, 3)
    expected = torch.softmax(logits.float(), -1).topk(3, -1).values
    assert torch.equal(weights, expected / expected.sum(-1, keepdim=True))


def test_route_matches_transformers_mixtral_router():
    transformers = pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter

    config = transformers.MixtralConfig(hidden_size=HF.hidden_size, num_local_experts=HF.num_local_experts,
                                        num_experts_per_tok=2)
    router = MixtralTopKRouter(config)
    torch.nn.init.normal_(router.weight, std=0.5)
    x = torch.randn(32, HF.hidden_size)
    _, ref_weights, ref_ids = router(x)
    weights, ids = route(F.linear(x, router.weight), 2)
    assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_weights)


def test_grouped_experts_equal_a_per_token_loop():
    w1, w3, w2 = _full_weights()
    experts = _fill(_experts(), w1, w3, w2)
    x = torch.randn(40, HF.hidden_size)
    weights, ids = route(torch.randn(40, HF.num_local_experts), 2)
    expected = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(2):
            e = ids[t, k]
            expected[t] += weights[t, k] * (F.silu(x[t] @ w1[e].T) * (x[t] @ w3[e].T)) @ w2[e].T
    assert torch.allclose(experts(x, weights, ids), expected, atol=1e-5)


def test_an_expert_no_token_chose_and_an_empty_batch_are_fine():
    experts = _fill(_experts(), *_full_weights())
    ids = torch.tensor([[0, 1], [1, 0], [0, 1]])  # experts 2..4 get nothing
    weights = torch.full((3, 2), 0.5)
    x = torch.randn(3, HF.hidden_size)
    assert experts(x, weights, ids).shape == x.shape
    empty = torch.empty(0, HF.hidden_size)
    assert experts(empty, torch.empty(0, 2), torch.empty(0, 2, dtype=torch.long)).shape == (0, HF.hidden_size)


def test_tensor_parallel_shards_sum_to_the_whole_block():
    weights_full = _full_weights(seed=3)
    x = torch.randn(20, HF.hidden_size)
    weights, ids = route(torch.randn(20, HF.num_local_experts), 2)
    whole = _fill(_experts(), *weights_full)(x, weights, ids)
    parts = [_fill(_experts(rank, tp=2), *weights_full) for rank in range(2)]
    assert all(p.gate_up_proj.shape == (HF.num_local_experts, HF.intermediate_size, HF.hidden_size) for p in parts)
    assert torch.allclose(sum(p(x, weights, ids) for p in parts), whole, atol=1e-5)
