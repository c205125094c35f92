"""``bench serve --dataset prefix-repetition`` (many users sharing a few system prompts) and the
``bench prefix-routing`` deployment's KV sizing."""

from __future__ import annotations

import argparse
import json
from collections import Counter

import pytest

from gridserve.benchmarks import prefix_routing, serve
from gridserve.benchmarks.datasets import (
    TokenizerVocabulary,
    WordVocabulary,
    prefix_repetition_requests,
)


def test_each_prefix_starts_an_equal_share_of_the_requests_in_a_mixed_order(llama_tiny):
    vocab = TokenizerVocabulary(llama_tiny)
    reqs = prefix_repetition_requests(10, vocab, prefix_len=32, suffix_len=8, num_prefixes=3, output_len=5, seed=2)
    assert reqs == prefix_repetition_requests(10, vocab, 32, 8, 3, 5, seed=2)
    assert all(isinstance(r.prompt, list) and r.prompt_len == len(r.prompt) == 40 and r.output_len == 5
               for r in reqs)
    shares = Counter(tuple(r.prompt[:32]) for r in reqs)
    assert sorted(shares.values()) == [3, 3, 4]
    assert len({tuple(r.prompt[32:]) for r in reqs}) == 10  # each user's own suffix
    order = [tuple(r.prompt[:32]) for r in reqs]
    assert sum(a != b for a, b in zip(order, order[1:])) > 2  # not grouped by prefix
    words = prefix_repetition_requests(4, WordVocabulary(), 6, 2, 2, 3)
    assert all(isinstance(r.prompt, str) and len(r.prompt.split()) == 8 for r in words)
    with pytest.raises(ValueError, match="--prefix-repetition-num-prefixes"):
        prefix_repetition_requests(4, vocab, 6, 2, 0, 3)


def test_bench_serve_takes_the_prefix_repetition_options(llama_tiny):
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--dataset", "prefix-repetition", "--num-prompts", "6",
                              "--prefix-repetition-prefix-len", "16", "--prefix-repetition-suffix-len", "4",
                              "--prefix-repetition-num-prefixes", "2", "--prefix-repetition-output-len", "7"])
    reqs = serve._requests(args, TokenizerVocabulary(llama_tiny), False, args.seed)
    assert len(reqs) == 6 and {r.prompt_len for r in reqs} == {20} and {r.output_len for r in reqs} == {7}
    assert len({tuple(r.prompt[:16]) for r in reqs}) == 2
    assert serve._ignore_eos(args)  # random tokens: exact output lengths


def test_the_kv_cache_holds_the_asked_prefixes_and_the_requests_own_blocks(llama_tiny):
    parser = argparse.ArgumentParser()
    prefix_routing.add_arguments(parser)
    args = parser.parse_args(["--prefix-len", "128", "--suffix-len", "16", "--output-len", "16",
                              "--max-concurrency", "8", "--data-parallel-size", "2"])
    flags = prefix_routing._engine_args(str(llama_tiny), args)
    config = json.loads((llama_tiny / "config.json").read_text())
    per_block = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * 16 * 4
    blocks = int(flags[flags.index("--kv-cache-memory-bytes") + 1]) // per_block
    # The null block, 2 prefixes of 8 blocks, and 3 blocks for each of twice 4 requests in flight.
    assert blocks == 1 + 2 * 8 + 2 * 4 * 3
    assert flags[flags.index("--max-model-len") + 1] == "160"
