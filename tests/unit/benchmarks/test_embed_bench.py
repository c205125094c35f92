"""``gridserve bench embed``'s pure parts: its flags, the input lengths and texts, the token budgets
and the summary's medians and ratios. No model, no sentence-transformers."""

from __future__ import annotations

import argparse

import pytest

from gridserve.benchmarks import embed_bench


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    embed_bench.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_defaults_are_issue_37s_workload() -> None:
    args = _parse()
    assert (args.num_inputs, args.runs, args.st_batch_sizes) == (256, 3, "32")
    assert args.workloads.split(",") == ["uniform", "mixed"]
    assert embed_bench.budgets(args.max_num_batched_tokens) == [None] and args.output_json is None


def test_flags_scale_the_run_down_and_add_settings() -> None:
    args = _parse("--num-inputs", "64", "--runs", "1", "--max-num-batched-tokens", "default,8192",
                  "--st-batch-sizes", "32,64", "--output-json", "x.json")
    assert (args.num_inputs, args.runs, args.output_json) == (64, 1, "x.json")
    assert embed_bench.budgets(args.max_num_batched_tokens) == [None, 8192]


def test_lengths_uniform_and_mixed() -> None:
    assert embed_bench.lengths("uniform", 5) == [128] * 5
    mixed = embed_bench.lengths("mixed", 2000, seed=3)
    assert len(mixed) == 2000 and min(mixed) == 16 and max(mixed) == 512
    assert 240 < sum(mixed) / len(mixed) < 290  # uniform in [16, 512]: mean 264
    assert mixed == embed_bench.lengths("mixed", 2000, seed=3) != embed_bench.lengths("mixed", 2000, seed=4)
    with pytest.raises(ValueError, match="unknown workload"):
        embed_bench.lengths("zipf", 3)


def test_texts_have_one_word_per_token_between_the_specials() -> None:
    texts = embed_bench.texts_for([16, 128, 512], vocab=30522, seed=1)
    assert [len(t.split()) for t in texts] == [14, 126, 510]
    ids = [int(w[1:]) for t in texts for w in t.split()]
    assert all(embed_bench.FIRST_WORD_ID <= i < 30522 for i in ids)


def test_summary_medians_and_ratio() -> None:
    st = embed_bench.summarize([4.0, 2.0, 3.0], num_inputs=30, num_tokens=3000)
    assert (st["median_s"], st["inputs_per_s"], st["tokens_per_s"]) == (3.0, 10.0, 1000.0)
    ours = embed_bench.summarize([1.5, 9.0, 1.0], num_inputs=30, num_tokens=3000)
    assert ours["median_s"] == 1.5 and embed_bench.ratio(ours, st) == 2.0
