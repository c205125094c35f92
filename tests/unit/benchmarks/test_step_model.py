"""The decode-step model's arithmetic (bytes, FLOPs, floors) on a tiny config counted by hand, and
its weight bytes read off a loaded model (fp32 and int8)."""

from __future__ import annotations

import pytest
import torch

from gridserve.benchmarks import step_model as sm

# 2 layers, hidden 8, intermediate 16, 2 query heads / 1 KV head of 4, vocab 10.
TINY = sm.DecoderShape(layers=2, hidden=8, intermediate=16, heads=2, kv_heads=1, head_dim=4, vocab=10)
# Per layer: QKV 8 x (2 + 2) * 4 = 128, O 8 x 8 = 64, gate/up 8 x 32 = 256, down 16 x 8 = 128.
LAYER_PARAMS = 128 + 64 + 256 + 128


def test_parameter_and_kv_counts():
    assert TINY.projection_params() == 2 * LAYER_PARAMS == 1152
    assert TINY.kv_elements_per_token() == 2 * 2 * 1 * 4  # layers x (K, V) x KV heads x head_dim
    assert sm.weight_bytes(TINY, 4) == {"mlp_proj": 4608, "lm_head": 320}
    assert sm.weight_bytes(TINY, 1) == {"mlp_proj": 1152, "lm_head": 80}


def test_step_costs_by_hand():
    costs = sm.step_costs(TINY, [3, 5], sm.weight_bytes(TINY, 4), kv_bytes_per_element=4)
    # KV: 16 elements x 4 bytes = 64 per token; 8 context tokens read, 2 new tokens written
    assert costs["attention"] == sm.Cost(bytes=8 * 64 + 2 * 64, flops=4 * 8 * 2 * 4 * 2)
    assert costs["mlp_proj"] == sm.Cost(bytes=4608, flops=2 * 2 * 1152)
    assert costs["lm_head"] == sm.Cost(bytes=320 + 2 * 10 * 4, flops=2 * 2 * 8 * 10)
    assert costs["sampler"] == sm.Cost(bytes=2 * 10 * 4, flops=0)
    assert costs["overhead"] == sm.Cost(bytes=0, flops=0)
    # a 16-bit cache halves the attention bytes only
    half = sm.step_costs(TINY, [3, 5], sm.weight_bytes(TINY, 4), kv_bytes_per_element=2)
    assert half["attention"].bytes == costs["attention"].bytes / 2
    assert half["mlp_proj"] == costs["mlp_proj"]


def test_floor_is_the_slower_of_bytes_and_flops_summed_over_components():
    costs = sm.step_costs(TINY, [3, 5], sm.weight_bytes(TINY, 4), kv_bytes_per_element=4)
    memory_bound = sm.floors(costs, sm.Machine(bandwidth=100.0, gemm_fp32=1000.0))
    assert memory_bound["attention"] == pytest.approx(640 / 100)  # 512 FLOPs / 1000 is less
    assert memory_bound["mlp_proj"] == pytest.approx(4608 / 100)
    assert memory_bound["lm_head"] == pytest.approx(400 / 100)
    assert memory_bound["sampler"] == pytest.approx(80 / 100)
    assert memory_bound["overhead"] == 0
    assert memory_bound["total"] == pytest.approx((640 + 4608 + 400 + 80) / 100)
    compute_bound = sm.floors(costs, sm.Machine(bandwidth=100.0, gemm_fp32=1.0))
    assert compute_bound["mlp_proj"] == pytest.approx(4608.0)
    # int8 weights use the int8 rate when it was probed, the fp32 rate otherwise
    machine = sm.Machine(bandwidth=1e9, gemm_fp32=1.0, gemm_int8=4.0)
    assert sm.floors(costs, machine, "int8")["mlp_proj"] == pytest.approx(4608 / 4)
    assert sm.floors(costs, sm.Machine(1e9, 1.0), "int8")["mlp_proj"] == pytest.approx(4608.0)


def test_report_ratios_and_table():
    costs = sm.step_costs(TINY, [3, 5], sm.weight_bytes(TINY, 4), kv_bytes_per_element=4)
    machine = sm.Machine(bandwidth=100e3, gemm_fp32=1e9)  # 100 KB/s: floors of a few ms
    achieved = {"attention": 12.8, "mlp_proj": 46.08, "lm_head": 8.0, "sampler": 0.8, "overhead": 3.0,
                "total": 70.68}
    rows = sm.report(achieved, costs, machine)
    assert rows["attention"]["achieved_over_floor"] == pytest.approx(2.0)
    assert rows["mlp_proj"]["floor_fraction"] == pytest.approx(1.0)
    assert rows["overhead"]["achieved_over_floor"] is None and rows["overhead"]["floor_ms"] == 0
    assert rows["total"]["floor_ms"] == pytest.approx(57.28)
    assert rows["attention"]["bound"] == "memory"
    table = sm.format_table(rows)
    assert table.splitlines()[0].split()[0] == "component" and "total" in table


def test_probe_measures_positive_rates():
    machine = sm.probe(batch=8, hidden=64, int8=True, buffer_bytes=4 << 20, repeats=2)
    assert machine.bandwidth > 1e8 and machine.gemm_fp32 > 1e7 and machine.gemm_int8 > 1e7


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_model_weight_bytes_match_the_shape(llama_tiny, quantization):
    from transformers import AutoConfig

    from gridserve.services.worker.loader import load_model
    from gridserve.shared.config import GridserveConfig

    config = GridserveConfig.from_kwargs(model=str(llama_tiny), quantization=quantization).finalize()
    model = load_model(config, torch.device("cpu"))
    shape = sm.DecoderShape.from_hf(AutoConfig.from_pretrained(str(llama_tiny)))
    stored = sm.model_weight_bytes(model)
    if quantization is None:
        assert sm.weights_kind(model) == "fp32"
        assert stored == sm.weight_bytes(shape, 4)
    else:  # one byte per weight plus an fp32 scale per output row
        assert sm.weights_kind(model) == "int8"
        assert sm.weight_bytes(shape, 1)["mlp_proj"] < stored["mlp_proj"] < sm.weight_bytes(shape, 1.1)["mlp_proj"]
