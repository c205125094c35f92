"""The pure parts of ``gridserve bench throughput``: workload generation, batching, summary arithmetic.

No model is loaded here; the benchmark itself is run by hand (``gridserve bench throughput``).
"""

from __future__ import annotations

import argparse
import math

import pytest

from gridserve.benchmarks.throughput import (
    FIRST_REGULAR_TOKEN_ID,
    SystemResult,
    Workload,
    _Timed,
    add_arguments,
    batches,
    compare_outputs,
    format_profile,
    format_table,
    generated_tokens_batched,
    make_workload,
    profile_ops,
    summarize,
)


def _result(name: str, tokens: int, seconds: float, requests: int = 4, cpu_s: float | None = None) -> SystemResult:
    return SystemResult(name=name, num_requests=requests, output_tokens=tokens, elapsed_s=seconds, cpu_s=cpu_s)


# ---- workload ---------------------------------------------------------------------------------


def test_make_workload_respects_ranges_and_vocab():
    w = make_workload(200, 3, 9, 2, 5, vocab_size=50, seed=1)
    assert w.num_requests == 200
    assert all(3 <= n <= 9 for n in w.prompt_lens)
    assert all(2 <= n <= 5 for n in w.output_lens)
    ids = [t for p in w.prompt_token_ids for t in p]
    assert min(ids) >= FIRST_REGULAR_TOKEN_ID and max(ids) < 50
    # the ranges are inclusive at both ends and actually used
    assert {min(w.prompt_lens), max(w.prompt_lens)} == {3, 9}
    assert {min(w.output_lens), max(w.output_lens)} == {2, 5}


def test_make_workload_is_deterministic_per_seed():
    a = make_workload(16, 4, 32, 1, 8, vocab_size=1000, seed=7)
    b = make_workload(16, 4, 32, 1, 8, vocab_size=1000, seed=7)
    c = make_workload(16, 4, 32, 1, 8, vocab_size=1000, seed=8)
    assert a == b
    assert a.prompt_token_ids != c.prompt_token_ids


def test_make_workload_fixed_lengths():
    w = make_workload(3, 5, 5, 7, 7, vocab_size=100)
    assert w.prompt_lens == [5, 5, 5]
    assert w.output_lens == [7, 7, 7]
    assert w.total_prompt_tokens == 15
    assert w.total_output_tokens == 21


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_prompts": 0},
        {"input_len_min": 0},
        {"input_len_min": 10, "input_len_max": 9},
        {"output_len_min": 3, "output_len_max": 2},
        {"vocab_size": FIRST_REGULAR_TOKEN_ID},
    ],
)
def test_make_workload_rejects_bad_arguments(kwargs):
    args = {"num_prompts": 2, "input_len_min": 1, "input_len_max": 4, "output_len_min": 1,
            "output_len_max": 4, "vocab_size": 100} | kwargs
    with pytest.raises(ValueError):
        make_workload(**args)


def test_workload_head_and_describe():
    w = Workload([[6, 7], [8], [9, 10, 11]], [4, 2, 3], seed=3)
    head = w.head(2)
    assert head.prompt_token_ids == [[6, 7], [8]]
    assert head.output_lens == [4, 2]
    assert w.head(10) == w
    assert w.describe() == {
        "num_requests": 3, "seed": 3, "total_prompt_tokens": 6, "total_output_tokens": 9,
        "prompt_len_min": 1, "prompt_len_max": 3, "output_len_min": 2, "output_len_max": 4,
    }


def test_workload_rejects_mismatched_lengths():
    with pytest.raises(ValueError):
        Workload([[6]], [1, 2], seed=0)


# ---- batching ---------------------------------------------------------------------------------


def test_batches_cover_everything_in_order():
    assert [list(b) for b in batches(7, 3)] == [[0, 1, 2], [3, 4, 5], [6]]
    assert [list(b) for b in batches(6, 64)] == [list(range(6))]
    assert list(batches(0, 4)) == []
    with pytest.raises(ValueError):
        list(batches(3, 0))


def test_generated_tokens_batched_counts_padding_waste():
    # batches [5, 1] and [2]: 2 * 5 + 1 * 2
    assert generated_tokens_batched([5, 1, 2], 2) == 12
    assert generated_tokens_batched([5, 1, 2], 1) == 8  # one at a time: no waste
    assert generated_tokens_batched([5, 1, 2], 64) == 15


# ---- summary ----------------------------------------------------------------------------------


def test_summarize_throughput_and_ratio():
    rows = summarize([_result("gridserve", 300, 2.0), _result("hf_batched", 300, 3.0),
                      _result("hf_single", 50, 5.0, requests=1)])
    by = {r["system"]: r for r in rows}
    assert by["gridserve"]["output_tok_per_s"] == pytest.approx(150.0)
    assert by["hf_batched"]["output_tok_per_s"] == pytest.approx(100.0)
    assert by["hf_single"]["output_tok_per_s"] == pytest.approx(10.0)
    assert by["gridserve"]["ratio_vs_hf_batched"] == pytest.approx(1.5)
    assert by["hf_batched"]["ratio_vs_hf_batched"] == pytest.approx(1.0)
    assert by["hf_single"]["ratio_vs_hf_batched"] == pytest.approx(0.1)
    assert [r["system"] for r in rows] == ["gridserve", "hf_batched", "hf_single"]
    assert by["hf_single"]["requests"] == 1 and by["hf_single"]["output_tokens"] == 50


def test_summarize_without_baseline_or_with_zero_time():
    rows = summarize([_result("gridserve", 10, 1.0)])
    assert rows[0]["ratio_vs_hf_batched"] is None
    rows = summarize([_result("gridserve", 10, 0.0), _result("hf_batched", 10, 1.0)])
    assert math.isnan(rows[0]["output_tok_per_s"])
    assert rows[0]["ratio_vs_hf_batched"] is None


def test_format_table_lists_every_system():
    rows = summarize([_result("gridserve", 300, 2.0, cpu_s=3.5), _result("hf_batched", 300, 3.0)])
    lines = format_table(rows).splitlines()
    assert lines[0].split()[0] == "system"
    assert lines[2].split() == ["gridserve", "4", "300", "2.00", "150.0", "1.50x", "3.5"]
    assert lines[3].split() == ["hf_batched", "4", "300", "3.00", "100.0", "1.00x", "-"]
    assert format_table(summarize([_result("gridserve", 1, 1.0)])).splitlines()[2].split()[-2:] == ["-", "-"]


def test_compare_outputs_cuts_to_wanted_length():
    ours = [[1, 2, 3], [1, 2, 3], [4, 5]]
    theirs = [[1, 2, 3, 9, 9], [1, 7, 3], [4, 5, 6]]  # HF batches run past a request's length
    info = compare_outputs(ours, theirs, [3, 3, 2])
    assert info["compared"] == 3
    assert info["identical"] == 2
    assert info["match_fraction"] == pytest.approx(2 / 3)
    assert info["mean_common_prefix_fraction"] == pytest.approx((1 + 1 / 3 + 1) / 3)


def test_compare_outputs_only_over_common_requests():
    info = compare_outputs([[1], [2], [3]], [[1]], [1, 1, 1])
    assert info["compared"] == 1 and info["identical"] == 1
    assert compare_outputs([], [], [])["match_fraction"] is None


def test_cli_defaults():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([])
    assert (args.num_prompts, args.input_len_min, args.input_len_max) == (64, 32, 256)
    assert (args.output_len_min, args.output_len_max, args.hf_batch_size, args.hf_single) == (16, 128, 64, 0)
    assert args.dtype == "float32" and args.model is None
    assert args.output_json == "benchmarks/results/throughput.json"


def test_timed_block_records_wall_cpu_and_timestamps():
    with _Timed() as timed:
        sum(range(10000))
    fields = timed.fields()
    assert fields["elapsed_s"] >= 0 and fields["cpu_s"] >= 0
    assert fields["started_at"] <= fields["finished_at"]
    result = SystemResult(name="x", num_requests=1, output_tokens=1, **fields)
    assert len(result.load_avg) == 2


# ---- --profile --------------------------------------------------------------------------------


def test_profile_ops_ranks_ops_by_self_time_with_their_share_of_the_wall():
    """The op that does the work comes first, with its call count; a wait no op accounts for
    (the sleep) leaves the shares summing to well under the wall."""
    import time

    import torch

    a = torch.randn(256, 256)

    def work():
        for _ in range(20):
            torch.mm(a, a)
        time.sleep(0.2)

    report = profile_ops(work, top=3)
    first = report["ops"][0]
    assert first["op"] == "aten::mm" and first["calls"] == 20
    assert report["wall_s"] >= 0.2 and 0 < first["share"] < 1
    assert sum(o["share"] for o in report["ops"]) < (report["wall_s"] - 0.2) / report["wall_s"] + 0.05
    assert len(report["ops"]) <= 3
    table = format_profile(report)
    assert "| aten::mm | 20 |" in table


def test_profile_flag_defaults_off():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).profile == 0 and parser.parse_args(["--profile", "12"]).profile == 12
