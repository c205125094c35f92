"""``gridserve bench edge`` end to end on the tiny model: three paths measured, figures written."""

from __future__ import annotations

import argparse
import json

import pytest

from gridserve.benchmarks import edge

pytestmark = pytest.mark.slow


def test_bench_edge_measures_every_path(llama_tiny, tmp_path, capsys):
    out = tmp_path / "edge.json"
    args = argparse.Namespace(model=str(llama_tiny), requests=4, max_tokens=2, output_json=str(out), tls=True)
    assert edge.run(args) == 0
    results = json.loads(out.read_text())
    for name in ("rest_via_envoy", "grpc_via_envoy", "grpc_direct"):
        for suffix in ("", "_tls"):  # a plaintext and a mutual-TLS deployment, interleaved
            summary = results[name + suffix]
            assert summary["n"] == 4 and 0 < summary["median_ms"] <= summary["p90_ms"]
    assert set(results["added_median_ms"]) == {"rest_via_envoy", "grpc_via_envoy"}
    assert set(results["tls_added_median_ms"]) == {"rest_via_envoy", "grpc_via_envoy", "grpc_direct"}
    printed = capsys.readouterr().out
    assert "edge adds" in printed and "TLS adds" in printed
