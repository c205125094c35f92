"""Quantization config and weights: errors naming the field, per-prefix choice, pack / unpack,
and the error each format allows against the float weight."""

from __future__ import annotations

import pytest
import torch

from gridserve.services.worker.quantization import Int4Weight, Int8Weight, QuantizationConfig
from gridserve.services.worker.quantization.weights import pack_int4, unpack_int4
from gridserve.shared.config import CacheConfig, GridserveConfig, ModelConfig
from gridserve.shared.errors import ConfigError


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"quantization": "int3"}, "model.quantization"),
        ({"kv_cache_dtype": "fp4"}, "cache.kv_cache_dtype"),
        ({"quantization_config": "{not json"}, "model.quantization_config"),
        (
            {"quantization_config": {"method": "int8", "ignore": "lm_head"}},
            "model.quantization_config.ignore",
        ),
        (
            {"quantization_config": {"method": "int8", "group_size": 0}},
            "model.quantization_config.group_size",
        ),
        ({"quantization_config": {"ignore": ["lm_head"]}}, "model.quantization_config.method"),
        (
            {"quantization": "int4", "quantization_config": {"method": "int8"}},
            "model.quantization_config.method",
        ),
        ({"quantization_config": {"method": "int8", "bits": 3}}, "model.quantization_config"),
        (
            {"quantization_config": {"method": "int8", "activation_rows": 3}},
            "model.quantization_config.activation_rows",
        ),
        (
            {"quantization_config": {"method": "int8", "activation_group": 64}},
            "model.quantization_config.activation_group",
        ),
        (
            {"quantization_config": {"method": "int8", "activation_group": 32, "activation_rows": 1}},
            "model.quantization_config.activation_rows",
        ),
    ],
)
def test_bad_quantization_values_are_errors_naming_the_field(kwargs, field):
    with pytest.raises(ConfigError) as err:
        GridserveConfig.from_kwargs(model="unused", **kwargs)
    assert err.value.field == field


def test_quantization_config_json_text_sets_the_method():
    model = ModelConfig(quantization_config='{"method": "int4", "ignore": ["lm_head"]}')
    assert model.quantization == "int4"
    assert model.quantization_config == {"method": "int4", "ignore": ["lm_head"]}


@pytest.mark.parametrize(
    ("dtype", "bytes_per_elem"),
    [("auto", 4), ("bfloat16", 2), ("float16", 2), ("fp8_e4m3", 1), ("fp8_e5m2", 1)],
)
def test_kv_bytes_per_token_follow_the_cache_dtype(dtype, bytes_per_elem):
    config = GridserveConfig(cache=CacheConfig(kv_cache_dtype=dtype))
    config.model.num_layers, config.model.num_kv_heads, config.model.head_dim = 4, 2, 64
    assert config.kv_bytes_per_token_per_rank() == 2 * 4 * 2 * 64 * bytes_per_elem


def test_method_for_prefix_honours_exact_regex_and_merged_part_names():
    config = QuantizationConfig(
        "int8", ["lm_head", r"re:model\.layers\.0\..*", "model.layers.2.self_attn.k_proj"]
    )
    assert config.method_for("lm_head") is None
    assert config.method_for("model.layers.0.mlp.down_proj") is None
    assert config.method_for("model.layers.1.mlp.down_proj") == "int8"
    assert config.method_for("model.layers.2.self_attn.qkv_proj") is None  # names its k_proj part
    assert (
        config.method_for("model.layers.10.self_attn.qkv_proj") == "int8"
    )  # regex matches in full
    config.check_all_matched()


def test_an_ignore_entry_matching_no_layer_is_an_error_naming_it():
    config = QuantizationConfig("int8", ["lm_head", "model.layers.99.mlp"])
    config.method_for("lm_head")
    with pytest.raises(ConfigError) as err:
        config.check_all_matched()
    assert err.value.field == "model.quantization_config.ignore"
    assert "model.layers.99.mlp" in str(err.value)


@pytest.mark.parametrize(
    ("raw", "group", "rows"),
    [({}, 0, 2), ({"activation_group": 0}, 0, 2), ({"activation_rows": 1}, 0, 1),
     ({"activation_group": 32}, 32, 2)],
)
def test_int8_activation_scheme_defaults_to_int16_rows(raw, group, rows):
    GridserveConfig.from_kwargs(model="unused", quantization_config={"method": "int8", **raw})
    config = QuantizationConfig.from_model_config("int8", raw)
    assert (config.activation_group, config.activation_rows) == (group, rows)


def test_int4_pack_round_trips_every_value():
    q = torch.arange(-8, 8, dtype=torch.int8).repeat(3, 4)  # [3, 64]
    packed = pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 32)
    assert torch.equal(unpack_int4(packed, 64), q)


def test_int8_weight_is_per_output_channel_and_close_to_float():
    gen = torch.Generator().manual_seed(0)
    w = (
        torch.randn(96, 256, generator=gen) * torch.linspace(0.01, 3.0, 96)[:, None]
    )  # rows of any scale
    q = Int8Weight.from_float(w)
    assert q.qweight.dtype == torch.int8 and q.scales.shape == (96,)
    rel = (q.dequantize() - w).abs().amax(1) / w.abs().amax(1)
    assert rel.max().item() <= 0.5 / 127 + 1e-6  # half a step of each row's own scale
    x = torch.randn(7, 256, generator=gen)
    exact = x @ w.T
    assert ((q(x) - exact).norm() / exact.norm()).item() < 0.01


def _int8_backend(backend: str, monkeypatch) -> None:
    """Make ``Int8Weight`` pick ``backend`` for its int16 mode: ``kernel`` (the C++ VNNI GEMM),
    ``onednn`` (oneDNN's int8 matmul, as on an AMX CPU) or ``torch`` (no compiler: two int8 rows
    through ``torch._int_mm``)."""
    from gridserve.kernels.cpu_ops import int8_gemm

    if backend == "torch":
        monkeypatch.setattr(int8_gemm, "load", lambda: None)  # as where no compiler builds it
    elif int8_gemm.load() is None:
        pytest.skip("the C++ int8 GEMM cannot be built here")
    if backend == "onednn" and not hasattr(torch.ops.onednn, "qlinear_pointwise"):
        pytest.skip("this torch has no oneDNN quantized linear")
    if backend == "onednn" and not int8_gemm.cpu_has_int8_dot():
        pytest.skip("no VNNI / AMX: oneDNN's int8 matmul saturates here, and onednn_available() says no")
    monkeypatch.setattr(int8_gemm, "onednn_available", lambda: backend == "onednn")


@pytest.mark.parametrize("backend", ["kernel", "onednn", "torch"])
def test_int8_cpu_matmul_keeps_activations_exact_enough_to_match_weight_only(backend, monkeypatch):
    """16-bit activations (the int8 x int16 kernel, oneDNN's int8 matmul on their two int8
    digits, or without a compiler two int8 rows per activation row): what is left is the weights'
    rounding alone, so the integer GEMM agrees with the dequantized weight in fp32 far closer than
    one int8 row per activation."""
    _int8_backend(backend, monkeypatch)
    kernel = backend == "kernel"
    x, w = _outlier_problem()
    q = Int8Weight.from_float(w)
    assert (q.kernel, q.onednn) == (kernel, backend == "onednn") and q.activation_group == 0
    weight_only = x @ q.dequantize().T
    err = ((q(x) - weight_only).norm() / weight_only.norm()).item()
    one_row = _fake_quantized(x, 512) @ q.dequantize().T  # one int8 scale per row
    err_one_row = ((one_row - weight_only).norm() / weight_only.norm()).item()
    assert err < 1e-3 and err < err_one_row / 50
    fast = Int8Weight.from_float(w, activation_rows=1)  # one int8 row, on request
    assert torch.allclose(fast(x), one_row, rtol=1e-4, atol=1e-4)
    if backend == "torch":  # int8 per 32 columns needs the kernel: two int8 rows without it
        assert torch.equal(Int8Weight.from_float(w, activation_group=32)(x), q(x))


def test_int8_through_onednn_equals_the_int16_kernel_and_is_batch_invariant(monkeypatch):
    """oneDNN's int8 matmul on the int16 rows' two digit planes forms the same integers as the
    VNNI kernel (results equal to float rounding), and a row's result does not depend on the
    rows beside it (its chunks of rows included)."""
    from gridserve.kernels.cpu_ops import int8_gemm

    _int8_backend("onednn", monkeypatch)
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(200, 300, generator=gen) * 0.05
    x = torch.randn(int8_gemm.onednn_rows(200) + 37, 300, generator=gen)
    x[:, 5] *= 30
    bias = torch.randn(200, generator=gen)
    q = Int8Weight.from_float(w)
    assert q.onednn and not hasattr(q, "packed") and not hasattr(q, "values")
    monkeypatch.setattr(int8_gemm, "onednn_available", lambda: False)
    vnni = Int8Weight.from_float(w)
    assert vnni.kernel and torch.equal(vnni.qweight, q.qweight)
    y = q(x)
    torch.testing.assert_close(y, vnni(x), rtol=1e-6, atol=1e-6 * y.abs().max().item())
    for i in (0, 1, int8_gemm.onednn_rows(200), x.shape[0] - 1):
        assert torch.equal(q(x[i:i + 1]), y[i:i + 1])
    with_bias = int8_gemm.onednn_gemm(x, q.onednn_weight, q.scales, 200, bias=bias)
    torch.testing.assert_close(with_bias, y + bias)
    assert int8_gemm.onednn_gemm(x[:0], q.onednn_weight, q.scales, 200).shape == (0, 200)


def test_int8_activations_per_32_columns_run_the_kernel_on_request():
    """``activation_group=32``: int8 activations with one scale per 32 columns through the kernel,
    equal to that quantization done in torch (float64), and far closer to weight-only than one
    scale per row (an outlier channel coarsens only its own group)."""
    from gridserve.kernels.cpu_ops import int8_gemm

    if int8_gemm.load() is None:
        pytest.skip("the C++ int8 GEMM cannot be built here")
    x, w = _outlier_problem()
    q = Int8Weight.from_float(w, activation_group=32)
    assert q.kernel and q.activation_group == 32
    weight_only = x @ q.dequantize().T
    grouped = (_fake_quantized(x.double(), 32) @ q.dequantize().double().T).float()
    torch.testing.assert_close(q(x), grouped, rtol=1e-5, atol=1e-5 * grouped.abs().max().item())
    one_row = _fake_quantized(x, 512) @ q.dequantize().T
    err = ((q(x) - weight_only).norm() / weight_only.norm()).item()
    assert err < ((one_row - weight_only).norm() / weight_only.norm()).item() / 3


def _outlier_problem() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(64, 512, generator=gen) * 0.05
    x = torch.randn(9, 512, generator=gen)
    x[:, 7] *= 40  # an outlier channel, as RMSNorm outputs have: one scale per row coarsens the rest
    return x, w


def _fake_quantized(x: torch.Tensor, group: int) -> torch.Tensor:
    """``x`` rounded to int8 with one symmetric scale per ``group`` columns (the kernel's rounding:
    ``round(x * (127 / amax))``, in float32) and scaled back."""
    g = x.float().reshape(x.shape[0], -1, group)
    amax = g.abs().amax(-1, keepdim=True)
    values = torch.round((g * (127.0 / amax)).clamp(-127, 127))
    return (values.to(x.dtype) * (amax / 127.0).to(x.dtype)).reshape(x.shape)


@pytest.mark.parametrize("backend", ["kernel", "onednn"])
def test_int8_weight_runs_an_integer_gemm_on_cpu_and_holds_the_weight_once(backend, monkeypatch):
    from gridserve.kernels.cpu_ops import int8_gemm

    _int8_backend(backend, monkeypatch)
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(100, 300, generator=gen) * 0.05
    q = Int8Weight.from_float(w)
    assert not hasattr(q, "values")
    if backend == "kernel":
        assert q.kernel and q.nbytes() == int8_gemm.load().packed_numel(100, 300) + 100 * 4  # packed once + scales
    else:
        assert q.onednn and q.nbytes() == 100 * 300 + 100 * 4
    reference = Int8Weight.from_float(w, activations=False)  # weight-only: the same int8 values
    assert torch.equal(q.qweight, reference.qweight)
    x = torch.randn(2, 3, 300, generator=gen)
    weight_only = reference(x)
    assert q(x).shape == (2, 3, 100)
    assert ((q(x) - weight_only).norm() / weight_only.norm()).item() < 1e-4  # int16: ~weight-only
    grouped = Int8Weight.from_float(w, activation_group=32)  # the VNNI kernel, int8 activations
    assert grouped.kernel and torch.equal(grouped.qweight, q.qweight)
    assert 1e-4 < ((grouped(x) - weight_only).norm() / weight_only.norm()).item() < 1e-2
    assert not Int8Weight.from_float(w, activation_rows=1).kernel  # torch._int_mm
    moved = Int8Weight.from_float(w, activation_group=32).to("meta")  # off the CPU (as .cuda()): plain int8 rows again
    assert not moved.kernel and moved.qweight.shape == (100, 300) and moved.qweight.dtype == torch.int8
    moved = q.to("meta")  # as sleep level 2 does: the packed copy goes
    assert not moved.onednn and not moved.kernel and moved.qweight.is_meta and moved.qweight.shape == (100, 300)


def test_int4_weight_uses_group_scales():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(16, 256, generator=gen)
    w[:, 128:] *= 100  # the second group's scale must not flatten the first group
    q = Int4Weight.from_float(w, group_size=128)
    assert q.scales.shape == (16, 2) and q.packed.shape == (16, 128)
    err = (q.dequantize() - w).abs()
    assert err[:, :128].max() <= w[:, :128].abs().max() / 14 + 1e-5
    x = torch.randn(5, 256, generator=gen)
    torch.testing.assert_close(q(x), x @ q.dequantize().T)


def test_engine_flags_carry_quantization_and_kv_cache_dtype(llama_tiny):
    import argparse

    from gridserve.roles import add_engine_arguments, engine_argv, engine_config

    parser = argparse.ArgumentParser()
    parser.add_argument("--model")
    add_engine_arguments(parser)
    argv = [
        "--model",
        str(llama_tiny),
        "--kv-cache-dtype",
        "fp8_e5m2",
        "--quantization",
        "int4",
        "--quantization-config",
        '{"method": "int4", "ignore": ["lm_head"], "group_size": 64}',
    ]
    args = parser.parse_args(argv)
    config = engine_config(args, ["127.0.0.1:1"])
    assert config.cache.kv_cache_dtype == "fp8_e5m2"
    assert config.model.quantization == "int4"
    assert config.model.quantization_config == {
        "method": "int4",
        "ignore": ["lm_head"],
        "group_size": 64,
    }
    forwarded = engine_argv(args)  # what `serve` hands its engine
    assert forwarded[forwarded.index("--kv-cache-dtype") + 1] == "fp8_e5m2"
    assert forwarded[forwarded.index("--quantization") + 1] == "int4"


def test_quantization_settings_survive_the_worker_protobuf(llama_tiny):
    from gridserve.shared.rpc.worker_convert import config_from_pb, config_to_pb

    config = GridserveConfig.from_kwargs(
        model=str(llama_tiny),
        kv_cache_dtype="bfloat16",
        quantization_config={"method": "int8", "ignore": ["lm_head"]},
    ).finalize()
    back = config_from_pb(config_to_pb(config))
    assert back.cache.kv_cache_dtype == "bfloat16"
    assert back.model.quantization == "int8"
    assert back.model.quantization_config == {"method": "int8", "ignore": ["lm_head"]}
    assert back.kv_bytes_per_token_per_rank() == config.kv_bytes_per_token_per_rank()


def test_onednn_int8_is_never_picked_on_a_cpu_without_vnni_or_amx(monkeypatch, caplog):
    """Forcing oneDNN (``GRIDSERVE_INT8_ONEDNN=1``) on a CPU with AVX2 alone, where its int8 matmul
    saturates, is ignored with a warning: the C++ kernel runs."""
    from gridserve.kernels.cpu_ops import int8_gemm

    monkeypatch.setenv("GRIDSERVE_INT8_ONEDNN", "1")
    monkeypatch.setattr(int8_gemm, "cpu_has_int8_dot", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    int8_gemm.onednn_available.cache_clear()
    try:
        with caplog.at_level("WARNING"):
            assert not int8_gemm.onednn_available()
        assert "saturates" in caplog.text
    finally:
        int8_gemm.onednn_available.cache_clear()
