"""``gridserve bench disaggregated``'s pieces: each engine's worker pinned (every thread) to its own
core, the cores and lengths refused when they cannot work, the ratios of the summary."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest

from gridserve.benchmarks.disagg_bench import _cores, _engine_args, _report, pin_workers


@dataclass
class _Proc:
    role: str
    group: int
    pid: int


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_each_engine_s_worker_is_pinned_with_all_its_threads_to_its_core():
    code = "import threading, time; [threading.Thread(target=time.sleep, args=(30,)).start() for _ in range(3)]; " \
           "print('up', flush=True); time.sleep(30)"
    children = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        for child in children:
            assert child.stdout.readline().strip() == "up"
        cores = _cores(None)
        procs = [_Proc("worker", rank, child.pid) for rank, child in enumerate(children)]
        pinned = pin_workers([_Proc("engine", 0, os.getpid()), *procs], cores)
        assert pinned == {children[0].pid: cores[0], children[1].pid: cores[1]}
        for child, core in zip(children, cores):
            tasks = os.listdir(f"/proc/{child.pid}/task")
            assert len(tasks) == 4 and all(os.sched_getaffinity(int(t)) == {core} for t in tasks)
    finally:
        for child in children:
            child.kill()
            child.wait()


def test_bad_cores_and_lengths_are_refused_naming_the_flag(tmp_path):
    with pytest.raises(ValueError, match="--cores"):
        _cores("0")
    with pytest.raises(ValueError, match="--cores"):
        _cores("1,1")
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4,
                                                      "num_hidden_layers": 2, "max_position_embeddings": 512}))
    args = argparse.Namespace(input_max=400, output_max=200, block_size=16, max_concurrency=4)
    with pytest.raises(ValueError, match="--input-max"):
        _engine_args(str(tmp_path), args)
    args.output_max = 100
    engine_args = _engine_args(str(tmp_path), args)
    blocks = 1 + 4 * 32  # 500 tokens: 32 blocks per request
    assert engine_args[engine_args.index("--kv-cache-memory-bytes") + 1] == str(blocks * 2 * 2 * 64 * 16 * 4)
    assert engine_args[engine_args.index("--max-model-len") + 1] == "512"


def test_the_summary_reports_both_deployments_and_the_ratios():
    def run(mode, ttft, itl, tput):
        return {"mode": mode, "output_throughput": tput, "median_ttft_ms": ttft / 2, "p99_ttft_ms": ttft,
                "median_itl_ms": itl / 2, "p99_itl_ms": itl}

    args = argparse.Namespace(rounds=1)
    summary = _report(args, "m", [], (0, 1), [run("disaggregated", 100.0, 20.0, 90.0),
                                              run("dp", 150.0, 60.0, 100.0)])["summary"]
    assert summary["ratios"] == {"ttft_p99_dp_over_disaggregated": 1.5, "itl_p99_dp_over_disaggregated": 3.0,
                                 "output_throughput_disaggregated_over_dp": 0.9}
    assert summary["goal"]["binding"] is False
