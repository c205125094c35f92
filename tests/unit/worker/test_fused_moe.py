"""The fused MoE layer (``services/worker/fused_moe.py``) against a plain per-token loop over the
same weights, at batch 1, 16 and 64 in fp32 and bf16; its bias hook, its TP shards and the router."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

from gridserve.services.worker.fused_moe import FusedMoE, route  # noqa: E402
from gridserve.services.worker.parallel_state import ParallelState  # noqa: E402
from gridserve.shared.parallel import RankLayout  # noqa: E402

EXPERTS, TOP_K, HIDDEN, INTER = 16, 4, 32, 24
# bf16: the layer rounds each GEMM's output and the activation to bf16; the reference does not
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def _weights(seed: int = 0, bias: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = {"gate": torch.randn(EXPERTS, INTER, HIDDEN, generator=g) / HIDDEN**0.5,
         "up": torch.randn(EXPERTS, INTER, HIDDEN, generator=g) / HIDDEN**0.5,
         "down": torch.randn(EXPERTS, HIDDEN, INTER, generator=g) / INTER**0.5}
    if bias:
        w |= {"gate_bias": torch.randn(EXPERTS, INTER, generator=g), "up_bias": torch.randn(EXPERTS, INTER, generator=g),
              "down_bias": torch.randn(EXPERTS, HIDDEN, generator=g)}
    return w


def _layer(w: dict[str, torch.Tensor], dtype=torch.float32, rank: int = 0, tp: int = 1) -> FusedMoE:
    layer = FusedMoE(EXPERTS, HIDDEN, INTER, ParallelState(RankLayout(rank, tp, 1)), bias="down_bias" in w)
    s = layer.shard
    layer.gate_up_proj.data.copy_(torch.cat([w["gate"][:, s.start : s.end], w["up"][:, s.start : s.end]], dim=1))
    layer.down_proj.data.copy_(w["down"][:, :, s.start : s.end])
    if layer.gate_up_bias is not None:
        layer.gate_up_bias.data.copy_(torch.cat([w["gate_bias"][:, s.start : s.end], w["up_bias"][:, s.start : s.end]], 1))
        layer.down_bias.data.copy_(w["down_bias"])
    return layer.to(dtype)


def _per_token(w: dict[str, torch.Tensor], x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Each token through each of its experts, one at a time, in float64."""
    w = {k: v.double() for k, v in w.items()}

    def bias(name: str, expert: int):
        return w[name][expert] if name in w else 0.0

    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        xt = x[t].double()
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate = w["gate"][e] @ xt + bias("gate_bias", e)
            up = w["up"][e] @ xt + bias("up_bias", e)
            out[t] += weights[t, k].double() * (w["down"][e] @ (F.silu(gate) * up) + bias("down_bias", e))
    return out


def _routed(batch: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, HIDDEN, generator=g)
    weights, ids = route(torch.randn(batch, EXPERTS, generator=g), TOP_K)
    return x, weights, ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 16, 64])
def test_the_fused_layer_equals_a_per_token_loop(batch, dtype):
    w = {k: v.to(dtype).float() for k, v in _weights().items()}  # the weights the layer holds, exactly
    x, weights, ids = _routed(batch)
    x = x.to(dtype)
    got = _layer(w, dtype)(x, weights, ids)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got.double(), _per_token(w, x, weights, ids), rtol=TOLERANCE[dtype],
                               atol=TOLERANCE[dtype])


def test_routing_weights_in_the_activations_dtype_are_taken_as_they_are():
    w = _weights()
    x, weights, ids = _routed(16)
    half = weights.to(torch.bfloat16)
    got = _layer(w)(x, half, ids)
    torch.testing.assert_close(got.double(), _per_token(w, x, half.float(), ids), rtol=1e-5, atol=1e-5)


def test_expert_biases_are_added_inside_each_expert():
    w = _weights(bias=True)
    x, weights, ids = _routed(16)
    torch.testing.assert_close(_layer(w)(x, weights, ids).double(), _per_token(w, x, weights, ids),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_tensor_parallel_shards_sum_to_the_whole_layer(bias):
    w = _weights(seed=3, bias=bias)
    x, weights, ids = _routed(20)
    whole = _layer(w)(x, weights, ids)
    parts = [_layer(w, rank=rank, tp=2) for rank in range(2)]
    assert all(p.gate_up_proj.shape == (EXPERTS, INTER, HIDDEN) for p in parts)
    torch.testing.assert_close(sum(p(x, weights, ids) for p in parts), whole, rtol=1e-5, atol=1e-5)


def test_experts_no_token_chose_and_an_empty_batch_are_fine():
    layer = _layer(_weights())
    ids = torch.tensor([[0, 1], [1, 0], [0, 1]])  # every other expert gets nothing
    x = torch.randn(3, HIDDEN)
    torch.testing.assert_close(layer(x, torch.full((3, 2), 0.5), ids).double(),
                               _per_token(_weights(), x, torch.full((3, 2), 0.5), ids), rtol=1e-5, atol=1e-5)
    empty = layer(torch.empty(0, HIDDEN), torch.empty(0, 2), torch.empty(0, 2, dtype=torch.long))
    assert empty.shape == (0, HIDDEN)


def test_route_without_renormalising_keeps_the_softmax_probabilities():
    logits = torch.randn(32, EXPERTS).to(torch.bfloat16)
    weights, ids = route(logits, TOP_K, renormalize=False)
    probs = torch.softmax(logits.float(), dim=-1)
    assert weights.dtype == torch.float32
    assert torch.equal(weights, probs.gather(1, ids)) and torch.equal(ids, probs.topk(TOP_K, -1).indices)
