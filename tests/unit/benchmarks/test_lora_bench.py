"""``gridserve bench lora``'s pure parts: its flags, which adapter each request names, server B's
flags, the run order and the summary's medians and ratios. No server, no model."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from gridserve.benchmarks import lora_bench


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    lora_bench.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_defaults_are_issue_35s_workload() -> None:
    args = _parse()
    assert (args.runs, args.num_adapters, args.rank, args.num_requests) == (3, 4, 16, 256)
    assert (args.input_lens, args.output_lens) == ("64-256", "32-256")
    assert args.targets.split(",") == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    assert args.model is None and not args.with_base_on_lora_server and args.output_json is None


def test_flags_scale_the_run_down() -> None:
    args = _parse("--num-requests", "32", "--runs", "1", "--with-base-on-lora-server", "--output-json", "x.json")
    assert (args.num_requests, args.runs, args.with_base_on_lora_server, args.output_json) == (32, 1, True, "x.json")


def test_request_i_names_adapter_i_mod_n() -> None:
    names = lora_bench.adapter_names(4)
    assert names == ["lora0", "lora1", "lora2", "lora3"]
    assigned = lora_bench.assign_adapters(10, names)
    assert assigned == [names[i % 4] for i in range(10)]
    assert {n: assigned.count(n) for n in names} == {"lora0": 3, "lora1": 3, "lora2": 2, "lora3": 2}
    assert lora_bench.assign_adapters(256, names).count("lora3") == 64
    with pytest.raises(ValueError):
        lora_bench.assign_adapters(3, [])


def test_lora_server_flags_name_every_adapter_and_allow_all_in_a_step() -> None:
    flags = lora_bench.lora_serve_args({"lora0": Path("/a/0"), "lora1": Path("/a/1")}, 16)
    assert flags[0] == "--enable-lora"
    assert flags[flags.index("--max-loras") + 1] == "2"
    assert flags[flags.index("--max-lora-rank") + 1] == "16"
    assert flags[flags.index("--lora-modules") + 1] == "lora0=/a/0,lora1=/a/1"


def test_servers_alternate_base_first() -> None:
    assert lora_bench.schedule(3) == [(1, "base"), (1, "lora"), (2, "base"), (2, "lora"), (3, "base"), (3, "lora")]


def _run(i: int, config: str, tok_s: float, ttft: float = 100.0, tpot: float = 10.0) -> dict:
    return {"run": i, "config": config, "output_tok_s": tok_s, "median_ttft_ms": ttft, "median_tpot_ms": tpot,
            "load_avg_at_start": [1.0, 1.0, 1.0]}


def test_summary_medians_and_ratios() -> None:
    runs = [_run(1, "base", 100.0, ttft=50.0), _run(1, "lora", 90.0, ttft=70.0),
            _run(2, "base", 120.0, ttft=60.0), _run(2, "lora", 84.0, ttft=80.0),
            _run(3, "base", 80.0, ttft=40.0), _run(3, "lora", 72.0, ttft=90.0)]
    s = lora_bench.summarize(runs)
    assert s["median_output_tok_s"] == {"base": 100.0, "lora": 84.0}
    assert s["median_ttft_ms"] == {"base": 50.0, "lora": 80.0}
    assert s["ratio_lora_over_base"] == 0.84
    assert s["paired_ratios_lora"] == [0.9, 0.7, 0.9]
    assert s["median_paired_ratio_lora"] == 0.9
    assert s["meets_bar"] is True
    assert "ratio_base_on_lora_server_over_base" not in s
    table = lora_bench.table(runs, s)
    assert "| median | lora | 84.0 | 80.0 | 10.0 | |" in table
    assert table.count("\n") == 1 + len(runs) + 2


def test_summary_with_config_c_and_a_miss() -> None:
    runs = [_run(1, "base", 100.0), _run(1, "lora", 50.0), _run(1, "base_on_lora_server", 95.0)]
    s = lora_bench.summarize(runs)
    assert s["ratio_lora_over_base"] == 0.5 and s["meets_bar"] is False
    assert s["ratio_base_on_lora_server_over_base"] == 0.95
    assert s["paired_ratios_base_on_lora_server"] == [0.95]


def test_summary_without_base_runs_has_no_ratio() -> None:
    s = lora_bench.summarize([_run(1, "lora", 50.0)])
    assert s["ratio_lora_over_base"] is None and s["meets_bar"] is None and s["paired_ratios_lora"] == []
