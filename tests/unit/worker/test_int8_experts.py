"""int8 experts (``FusedMoE.quantize``, ``quantization/experts.py``): the quantized layer computes
what the float layer computes with the dequantized weights (only the activations' int16 rounding
apart), stays close to the float layer, holds about a quarter of the float bytes, runs the dense
path's int8 CPU GEMM per expert, quantizes only the experts each expert-parallel rank holds, and
``quantize_model`` picks the experts by prefix like any linear layer."""

from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")

from gridserve.kernels.cpu_ops import int8_gemm  # noqa: E402
from gridserve.services.worker.checkpoint import CheckpointTensor, LoadReport  # noqa: E402
from gridserve.services.worker.fused_moe import FusedMoE, expert_parameter_bytes, route  # noqa: E402
from gridserve.services.worker.parallel_state import ParallelState  # noqa: E402
from gridserve.services.worker.quantization import (  # noqa: E402
    Int4Weight,
    Int8Weight,
    QuantizationConfig,
    QuantizedExperts,
    quantize_model,
)
from gridserve.shared.errors import ConfigError, FailedPreconditionError  # noqa: E402
from gridserve.shared.parallel import RankLayout  # noqa: E402
from tests.unit.worker.test_expert_parallel import _run_ranks  # noqa: E402
from tests.unit.worker.test_quantization import _int8_backend  # noqa: E402

# multiples of 64 rows and of 4 columns: the int8 kernel's packed layout pads nothing
EXPERTS, TOP_K, HIDDEN, INTER = 8, 2, 64, 32


def _layer(seed: int = 0, bias: bool = False, rank: int = 0, tp: int = 1, ep=None) -> FusedMoE:
    g = torch.Generator().manual_seed(seed)
    layer = FusedMoE(EXPERTS, HIDDEN, INTER, ParallelState(RankLayout(rank, tp, 1), ep=ep), bias=bias)
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) / HIDDEN**0.5
    down = torch.randn(EXPERTS, HIDDEN, INTER, generator=g) / INTER**0.5
    e, s = layer.experts, layer.shard
    rows = torch.cat([torch.arange(s.start, s.end), INTER + torch.arange(s.start, s.end)])
    layer.gate_up_proj.data.copy_(gate_up[e.start : e.end, rows])
    layer.down_proj.data.copy_(down[e.start : e.end, :, s.start : s.end])
    if bias:
        layer.gate_up_bias.data.copy_(torch.randn(EXPERTS, 2 * INTER, generator=g)[e.start : e.end, rows])
        layer.down_bias.data.copy_(torch.randn(EXPERTS, HIDDEN, generator=g)[e.start : e.end])
    return layer


def _inputs(tokens: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=g)
    weights, ids = route(torch.randn(tokens, EXPERTS, generator=g), TOP_K)
    return x, weights, ids


def _quantized(layer: FusedMoE, method: str = "int8", **settings) -> FusedMoE:
    layer.quantize(method, **settings)
    return layer


def _dequantized_float(quantized: FusedMoE, seed: int, bias: bool, **kwargs) -> FusedMoE:
    """A float layer holding exactly the weights the quantized layer's values stand for."""
    layer = _layer(seed, bias, **kwargs)
    layer.gate_up_proj.data.copy_(quantized.gate_up_quantized.dequantize())
    layer.down_proj.data.copy_(quantized.down_quantized.dequantize())
    return layer


@pytest.mark.parametrize("backend", ["kernel", "onednn", "torch"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("batch", [1, 16, 64])
def test_int8_experts_compute_the_float_layer_on_their_dequantized_weights(batch, bias, backend, monkeypatch):
    """On every int8 CPU path the dense layers have: the C++ kernel, oneDNN, torch._int_mm."""
    _int8_backend(backend, monkeypatch)
    q = _quantized(_layer(bias=bias))
    assert {(w.kernel, w.onednn) for w in q.down_quantized.weights} == {(backend == "kernel", backend == "onednn")}
    assert q.gate_up_proj is None and q.down_proj is None and q.quantization == "int8"
    x, weights, ids = _inputs(batch)
    got = q(x, weights, ids)
    reference = _dequantized_float(q, 0, bias)(x, weights, ids)
    # int16 activation rows: ~1 / 32767 of each row's largest value, twice (gate_up, then down)
    torch.testing.assert_close(got, reference, rtol=0, atol=1e-3 * reference.abs().max().item())
    # and close to the float experts: each weight rounded to 1 / 254 of its row's largest value
    exact = _layer(bias=bias)(x, weights, ids)
    assert (got - exact).norm() / exact.norm() < 2e-2


def test_bf16_activations_through_int8_experts_stay_bf16_and_near_the_dequantized_weights():
    q = _quantized(_layer(bias=True).to(torch.bfloat16))
    x, weights, ids = _inputs(16)
    got = q(x.bfloat16(), weights, ids)
    assert got.dtype == torch.bfloat16
    reference = _dequantized_float(q, 0, True)
    reference.gate_up_bias.data.copy_(q.gate_up_bias.float())
    reference.down_bias.data.copy_(q.down_bias.float())
    expected = reference(x.bfloat16().float(), weights, ids)
    assert (got.float() - expected).norm() / expected.norm() < 1e-2  # bf16 activations between the GEMMs


def test_each_experts_matrix_is_int8_with_one_scale_per_output_row():
    layer = _layer()
    gate_up = layer.gate_up_proj.data.clone()
    q = _quantized(layer)
    assert len(q.gate_up_quantized) == EXPERTS and all(isinstance(w, Int8Weight) for w in q.gate_up_quantized.weights)
    for e in range(EXPERTS):
        w = q.gate_up_quantized.weights[e]
        assert w.qweight.dtype == torch.int8 and w.scales.shape == (2 * INTER,)
        torch.testing.assert_close(w.scales, gate_up[e].abs().amax(dim=1) / 127.0)
        assert (w.dequantize() - gate_up[e]).abs().max() <= w.scales.max() / 2 + 1e-7


def test_int8_experts_hold_about_a_quarter_of_the_float_bytes():
    model = torch.nn.Module()
    model.experts = _layer()
    fp32, held = expert_parameter_bytes(model)
    assert fp32 == 4 * EXPERTS * 3 * INTER * HIDDEN and held == f"experts [0, {EXPERTS}) of {EXPERTS}"
    model.experts.quantize("int8")
    int8, _ = expert_parameter_bytes(model)
    scales = 4 * EXPERTS * (2 * INTER + HIDDEN)  # one float32 per output row of each expert
    assert int8 >= EXPERTS * 3 * INTER * HIDDEN + scales  # one byte a weight (a packed layout may pad)
    assert 0.25 < int8 / fp32 < 0.3, int8 / fp32


def test_int8_experts_run_the_dense_paths_integer_gemm_on_cpu():
    if int8_gemm.load() is None:
        pytest.skip("the C++ int8 GEMM cannot be built here (the torch._int_mm path runs instead)")
    q = _quantized(_layer())
    assert all(w.kernel or w.onednn for p in (q.gate_up_quantized, q.down_quantized) for w in p.weights)


@pytest.mark.parametrize(("settings", "bound"), [({"activations": False}, 1e-5), ({"activation_rows": 1}, 2e-2)])
def test_the_dense_int8_activation_settings_apply_to_the_experts(settings, bound):
    """weight-only: exact activations (the dequantized weights, to float rounding); one int8 row per
    activation: coarser, still near."""
    q = _quantized(_layer(), **settings)
    x, weights, ids = _inputs(16)
    reference = _dequantized_float(q, 0, False)(x, weights, ids)
    got = q(x, weights, ids)
    assert (got - reference).norm() / reference.norm() < bound


def test_int4_experts_use_group_scales():
    q = _quantized(_layer(), "int4", group_size=32)
    assert all(isinstance(w, Int4Weight) and w.group_size == 32 for w in q.down_quantized.weights)
    x, weights, ids = _inputs(16)
    reference = _dequantized_float(q, 0, False)(x, weights, ids)
    torch.testing.assert_close(q(x, weights, ids), reference, rtol=1e-5, atol=1e-5)


def test_each_tp_rank_quantizes_its_own_shard_of_every_expert():
    whole = _quantized(_layer())
    for rank in range(2):
        part = _quantized(_layer(rank=rank, tp=2))
        half = torch.cat([torch.arange(rank * INTER // 2, (rank + 1) * INTER // 2),
                          INTER + torch.arange(rank * INTER // 2, (rank + 1) * INTER // 2)])
        for e in range(EXPERTS):  # column-parallel rows: the same int8 values and scales
            assert torch.equal(part.gate_up_quantized.weights[e].qweight, whole.gate_up_quantized.weights[e].qweight[half])


def test_expert_parallel_ranks_quantize_only_their_experts_and_match_one_rank():
    single = _quantized(_layer())
    inputs = [_inputs(5, seed=2), _inputs(3, seed=3)]

    def body(group):
        layer = _quantized(_layer(ep=group))
        assert len(layer.gate_up_quantized) == EXPERTS // 2  # this rank's experts only
        out = layer(*inputs[group.rank])
        layer.dummy_step()  # zero tokens through quantized experts: the collectives still pair
        return out, [w.qweight for w in layer.down_quantized.weights]

    results = _run_ranks(2, body)
    for rank, result in enumerate(results):
        assert not isinstance(result, Exception), result
        out, values = result
        held = range(rank * EXPERTS // 2, (rank + 1) * EXPERTS // 2)
        assert all(torch.equal(v, single.down_quantized.weights[e].qweight) for v, e in zip(values, held))
        torch.testing.assert_close(out, single(*inputs[rank]), rtol=1e-5, atol=1e-5)


class _Model(torch.nn.Module):
    """Two MoE layers at their checkpoint paths, as a decoder holds them."""

    def __init__(self) -> None:
        super().__init__()
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList()
        for i in range(2):
            layer = torch.nn.Module()
            layer.mlp = torch.nn.Module()
            layer.mlp.experts = _layer(seed=i)
            self.model.layers.append(layer)


def test_quantize_model_quantizes_the_experts_by_prefix_and_honours_ignore():
    model = _Model()
    config = QuantizationConfig("int8", ignore=[r"re:model\.layers\.1\..*"])
    chosen = quantize_model(model, config, num_layers=2)
    assert chosen == {"model.layers.0.mlp.experts": "int8", "model.layers.1.mlp.experts": "none"}
    assert model.model.layers[0].mlp.experts.quantization == "int8"
    assert model.model.layers[1].mlp.experts.quantization is None
    with pytest.raises(ConfigError):  # an ignore entry naming no layer or experts is still a typo
        quantize_model(_Model(), QuantizationConfig("int8", ignore=["model.layers.0.mlp.gate"]), num_layers=2)


def test_loading_float_weights_into_quantized_experts_is_refused():
    layer = _quantized(_layer())
    tensor = CheckpointTensor("down", (EXPERTS, HIDDEN, INTER), lambda index: torch.zeros(EXPERTS, HIDDEN, INTER)[index],
                              LoadReport())
    with pytest.raises(FailedPreconditionError, match="quantized"):
        layer.load_stacked("down_proj", tensor)


def test_quantized_experts_refuse_an_unknown_method():
    with pytest.raises(ValueError, match="int3"):
        QuantizedExperts.from_float(torch.zeros(2, 4, 4), "int3")


def test_gpt_oss_experts_that_do_not_split_across_ep_ranks_name_num_local_experts():
    from gridserve.services.worker.models.gpt_oss import GptOssMoE

    class Group:
        rank, size = 0, 4

    hf = types.SimpleNamespace(num_local_experts=6, num_experts_per_tok=2, hidden_size=8, intermediate_size=4)
    with torch.device("meta"), pytest.raises(ConfigError) as err:
        GptOssMoE(hf, ParallelState(RankLayout(0, 1, 1), ep=Group()))
    assert err.value.field == "model.hf_config.num_local_experts"
