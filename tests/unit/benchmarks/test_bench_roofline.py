"""``gridserve bench roofline``: W's FLOPs on a model's shape and the report that sets them against a
GEMM rate and a bench peer run (pure arithmetic; the GEMM probe itself is the command's)."""

from __future__ import annotations

import pytest

from gridserve.benchmarks.roofline import PRECISIONS, format_report, report, workload_flops
from gridserve.benchmarks.step_model import DecoderShape

SMOLLM2 = DecoderShape(layers=30, hidden=576, intermediate=1536, heads=9, kv_heads=3, head_dim=64, vocab=49152)


def test_w_flops_count_every_fed_token_through_the_projections_and_every_sampled_one_through_the_head():
    flops = workload_flops(SMOLLM2, 2, (10, 10), (4, 4))
    per_token = 30 * (576 * 960 + 576 * 576 + 576 * 3072 + 1536 * 576)
    assert flops["projections"] == 2.0 * per_token * (20 + 2 * 3)  # prompts + outputs fed back (not the last)
    assert flops["lm_head"] == 2.0 * 576 * 49152 * 8
    # attention: sum of p^2 / 2 over prompts, then each output token's context
    assert flops["attention"] == pytest.approx(4.0 * 9 * 64 * 30 * (2 * 100 / 2 + 2 * 4 * (10 + 2)))
    given = workload_flops(SMOLLM2, 256, (64, 256), (32, 256), prompt_tokens=40842, output_tokens=36555)
    assert given["prompt_tokens"] == 40842 and given["output_tokens"] == 36555
    assert 18e12 < given["projections"] + given["lm_head"] < 20e12  # ~19 TFLOP: W on SmolLM2


def _peer(rows):
    return {"rounds": [{"variants": [{"variant": {"name": n, "server": s, "pair": p},
                                      "run": {"completed": 256, "output_throughput": t}} for n, s, p, t in rows]}]}


def test_report_sets_measured_servers_against_the_floor_and_the_target():
    flops = {"projections": 8e12, "lm_head": 2e12, "attention": 0.5e12, "output_tokens": 10_000}
    rates = {p: {"rate_flops": r} for p, r in zip(PRECISIONS, (100e9, 400e9, 500e9))}
    peer = _peer([("gridserve-fp32", "gridserve", "fp32", 50.0), ("vllm-fp32", "vllm", "fp32", 40.0),
                  ("vllm-bf16", "vllm", "bf16", 150.0), ("gridserve-int8", "gridserve", "int8", 300.0)])
    rows = report(flops, rates, peer, target=2.0)
    fp32 = rows["fp32"]
    assert fp32["floor_s"] == pytest.approx(100.0) and fp32["max_output_tok_s"] == pytest.approx(100.0)
    assert fp32["gridserve"]["gridserve-fp32"]["of_max"] == pytest.approx(0.5)
    assert fp32["vllm"]["target_tok_s"] == 80.0 and fp32["vllm"]["target_over_max"] == pytest.approx(0.8)
    assert fp32["vllm"]["target_needs_gemm_gflops_per_s"] == pytest.approx(10e12 / 125 / 1e9)
    assert rows["int8"]["vllm"]["tok_s"] == 150.0  # int8 is held to vLLM bf16
    lines = format_report(rows, 2.0).splitlines()
    assert lines[1].startswith("fp32") and lines[1].endswith("80 tok/s = 0.80x max")
    assert "gridserve-int8 300 (60%)" in lines[3]
