"""``gridserve bench executor`` runs end to end on a tiny model (a smoke test; figures are not checked)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_executor_benchmark_reports_both_executors_and_a_ratio(llama_tiny, tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, "-m", "gridserve.cli", "bench", "executor", "--model", str(llama_tiny),
         "--num-prompts", "4", "--input-len", "8", "--output-len", "4", "--repeats", "1",
         "--kv-cache-memory-bytes", str(16 << 20), "--output-json", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "grpc/uni throughput ratio" in result.stdout
    report = json.loads(out.read_text())
    assert {r["executor"] for r in report["runs"]} == {"uni", "grpc"}
    assert all(r["output_tokens"] == 16 for r in report["runs"])
    assert report["ratio"] > 0
