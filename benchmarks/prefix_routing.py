"""``gridserve bench prefix-routing``: cache-aware routing vs load routing over DP engines (issue 41).

    gridserve bench prefix-routing                      # 4 engines, prefix / load alternated, 2 rounds
    gridserve bench prefix-routing --rounds 1 --users-per-prefix 16   # a quick check

**Deployment**, one per run (every run starts with cold caches): ``--data-parallel-size`` engines (4),
each with one worker, the coordinator, one gateway with ``--routing-policy prefix`` or ``load``, and
the Envoy edge, all through the launcher (``gridserve serve -dp 4``'s processes). Each engine's KV
cache holds ``--kv-prefixes`` (2) of the shared prefixes plus the own blocks (suffix and output) of
twice its share of the requests in flight (``2 x --max-concurrency / DP``): under load routing every
engine sees every prefix and keeps evicting them, under prefix routing each holds about
``num_prefixes / DP`` of them.

**Workload**: ``bench serve``'s ``prefix-repetition`` set and client: ``--num-prefixes`` (8) system
prompts of ``--prefix-len`` tokens, ``--users-per-prefix`` requests each with a suffix of its own
(``--suffix-len``) and ``--output-len`` tokens (``ignore_eos``, greedy), in a seeded random order,
all sent at once with at most ``--max-concurrency`` (16) in flight. The defaults are the issue's
shape, 8 prompts of 1,024 tokens x 50 users, on a scaled-down model (the recipe's llama-small: 5M
parameters, 2,048 positions) with short outputs (16 tokens), so that a round (two deployments, two
runs) takes about 1.5 minutes on a 2-core machine.

**Runs** alternate prefix, load (``--rounds`` times; round ``r`` sends the same requests, seed
``r``, under both). Per run: the prefix-cache hit rate (prompt tokens the engines found cached /
looked up, from their ``vllm:prefix_cache_*`` counters), the output throughput, median and p99
TTFT, and how many requests each engine served. Summary: per policy the medians over rounds and
the throughput ratio prefix / load (issue 41's goal: >= 1.5). The JSON goes to
``benchmarks/results/prefix_routing.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from gridserve.benchmarks.harness import metric_sums, post_completion

logger = logging.getLogger(__name__)

RESULTS = Path(__file__).resolve().parent / "results"
POLICIES = ("prefix", "load")
GOAL = 1.5  # issue 41: prefix routing's output throughput >= 1.5x load routing's
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="checkpoint folder (default: the recipe's llama-small, built on first use)")
    parser.add_argument("--data-parallel-size", type=int, default=4, help="engines")
    parser.add_argument("--num-prefixes", type=int, default=8, help="shared system prompts")
    parser.add_argument("--users-per-prefix", type=int, default=50, help="requests per system prompt")
    parser.add_argument("--prefix-len", type=int, default=1024, help="tokens of each system prompt")
    parser.add_argument("--suffix-len", type=int, default=32, help="tokens of each request's own part")
    parser.add_argument("--output-len", type=int, default=16, help="output tokens per request")
    parser.add_argument("--kv-prefixes", type=float, default=2.0,
                        help="KV cache per engine, in system prompts it holds (plus its requests' own blocks)")
    parser.add_argument("--max-concurrency", type=int, default=16, help="requests in flight at most")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--rounds", type=int, default=2, help="runs per policy, prefix and load alternating")
    parser.add_argument("--log-dir", default=None, help="keep the roles' logs here (default: a temp folder)")
    parser.add_argument("--output-json", default=str(RESULTS / "prefix_routing.json"))


def run(args: argparse.Namespace) -> int:
    from gridserve.benchmarks.datasets import (
        TokenizerVocabulary,
        find_tokenizer,
        prefix_repetition_requests,
    )

    logging.getLogger("httpx2").setLevel(logging.WARNING)
    model = args.model or str(_recipe_model())
    tokenizer = find_tokenizer(model)
    if tokenizer is None:
        raise ValueError(f"--model {model}: no tokenizer.json there")
    vocabulary = TokenizerVocabulary(tokenizer)
    engine_args = _engine_args(model, args)
    num_prompts = args.num_prefixes * args.users_per_prefix
    print(f"prefix-routing: {args.data_parallel_size} engines, {args.num_prefixes} prefixes x "
          f"{args.users_per_prefix} users ({args.prefix_len} + {args.suffix_len} tokens, {args.output_len} out), "
          f"max concurrency {args.max_concurrency}; engine args: {' '.join(engine_args)}", flush=True)
    runs = []
    with tempfile.TemporaryDirectory(prefix="gridserve-bench-prefix-routing-") as tmp:
        log_root = Path(args.log_dir or tmp)
        for round_ in range(args.rounds):
            requests = prefix_repetition_requests(num_prompts, vocabulary, args.prefix_len, args.suffix_len,
                                                  args.num_prefixes, args.output_len, seed=round_)
            for policy in POLICIES:
                record = _measure(model, engine_args, policy, requests, args, log_root / f"{policy}-{round_}")
                record["round"] = round_
                runs.append(record)
                print(_run_line(record), flush=True)
    report = _report(args, model, engine_args, runs)
    print(_summary_table(report["summary"]))
    path = Path(args.output_json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    logger.info("wrote %s", path)
    return 0 if all(r["failed"] == 0 for r in runs) else 1


def _recipe_model() -> Path:
    from gridserve.demo.recipe import ensure_checkpoint

    return ensure_checkpoint("llama", "small")


def _engine_args(model: str, args: argparse.Namespace) -> list[str]:
    """A KV cache of ``--kv-prefixes`` prompts plus the running requests' own blocks, per engine."""
    config = json.loads((Path(model) / "config.json").read_text())
    text = config.get("text_config", config)
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    kv_heads = text.get("num_key_value_heads", text["num_attention_heads"])
    dtype = "float32"
    bytes_per_block = 2 * text["num_hidden_layers"] * kv_heads * head_dim * args.block_size * DTYPE_BYTES[dtype]
    prefix_blocks = math.ceil(args.prefix_len / args.block_size)
    own_blocks = math.ceil((args.suffix_len + args.output_len) / args.block_size) + 1
    running = 2 * math.ceil(args.max_concurrency / args.data_parallel_size)  # twice its share: bursts
    blocks = 1 + math.ceil(args.kv_prefixes * prefix_blocks) + running * own_blocks  # 1: the null block
    max_model_len = args.block_size * math.ceil((args.prefix_len + args.suffix_len + args.output_len)
                                                / args.block_size)
    return ["--dtype", dtype, "--block-size", str(args.block_size), "--max-model-len", str(max_model_len),
            "--kv-cache-memory-bytes", str(blocks * bytes_per_block), "--max-num-seqs", "64"]


def _measure(model: str, engine_args: list[str], policy: str, requests: list, args: argparse.Namespace,
             log_dir: Path) -> dict[str, Any]:
    """One run: a fresh deployment routing by ``policy``, the workload, its figures."""
    from gridserve.benchmarks.serve import Endpoint, LoadSpec, measure_run, model_card
    from gridserve.launcher import Launcher, free_port

    launcher = Launcher(model, engine_args, data_parallel_size=args.data_parallel_size, api_server_count=1,
                        edge_port=free_port(), grace_s=2.0, log_dir=log_dir,
                        gateway_args=["--routing-policy", policy])
    started = time.monotonic()
    launcher.start()
    try:
        base_url = f"http://{launcher.edge_address}"
        engines = [p for p in launcher.processes if p.role == "engine"]
        served_model = model_card(base_url, None)["id"]
        _warm_up(base_url, served_model, len(engines))
        before = [_counters(e.metrics_address) for e in engines]
        endpoint = Endpoint(base_url, "/v1/completions", served_model, None, ignore_eos=True, temperature=0.0)
        load = LoadSpec(math.inf, args.max_concurrency, timeout_s=600.0, max_duration_s=1800.0, progress=False)
        record = measure_run(endpoint, requests, load)
        after = [_counters(e.metrics_address) for e in engines]
    finally:
        launcher.stop()
    queries = sum(a["queries"] - b["queries"] for a, b in zip(after, before))
    hits = sum(a["hits"] - b["hits"] for a, b in zip(after, before))
    return {"policy": policy, "hit_rate": hits / queries if queries else 0.0,
            "requests_per_engine": [a["requests"] - b["requests"] for a, b in zip(after, before)],
            "preemptions": sum(a["preemptions"] - b["preemptions"] for a, b in zip(after, before)),
            "kv_cache": launcher.kv_cache_lines[:1], "deployment_s": round(time.monotonic() - started, 1),
            **{k: record[k] for k in ("completed", "failed", "duration", "output_throughput",
                                      "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
                                      "load_avg", "errors")}}


def _warm_up(base_url: str, model: str, num_engines: int) -> None:
    """One short request per engine (``data_parallel_rank``), none sharing a block with the workload."""
    rng = random.Random(12345)
    for rank in range(num_engines):
        body = {"model": model, "prompt": [rng.randrange(100, 4000) for _ in range(8)], "max_tokens": 2,
                "temperature": 0.0, "data_parallel_rank": rank}
        post_completion(base_url, body)


def _counters(metrics_address: Optional[str]) -> dict[str, float]:
    """An engine's prefix-cache counters and finished requests, from its Prometheus /metrics."""
    return metric_sums(metrics_address, {"vllm:prefix_cache_queries_total": "queries",
                                         "vllm:prefix_cache_hits_total": "hits",
                                         "vllm:request_prompt_tokens_count": "requests",
                                         "vllm:num_preemptions_total": "preemptions"})


def _run_line(r: dict[str, Any]) -> str:
    return (f"round {r['round']} {r['policy']:>6}: hit rate {100 * r['hit_rate']:5.1f} %, "
            f"{r['output_throughput']:7.1f} output tok/s, TTFT median {r['median_ttft_ms']:7.0f} ms, "
            f"p99 {r['p99_ttft_ms']:7.0f} ms, {r['completed']} done / {r['failed']} failed in {r['duration']:.1f} s; "
            f"requests per engine {[int(n) for n in r['requests_per_engine']]}, {int(r['preemptions'])} preemptions")


def _report(args: argparse.Namespace, model: str, engine_args: list[str], runs: list[dict[str, Any]]) -> dict:
    summary: dict[str, Any] = {}
    for policy in POLICIES:
        mine = [r for r in runs if r["policy"] == policy]
        summary[policy] = {key: statistics.median(r[key] for r in mine)
                           for key in ("hit_rate", "output_throughput", "median_ttft_ms", "p99_ttft_ms")}
    load_tput = summary["load"]["output_throughput"]
    summary["throughput_ratio"] = summary["prefix"]["output_throughput"] / load_tput if load_tput else math.nan
    summary["goal"] = GOAL
    return {"benchmark": "prefix-routing", "model": model, "engine_args": engine_args,
            "config": {k: v for k, v in vars(args).items() if not callable(v)}, "runs": runs, "summary": summary}


def _summary_table(summary: dict[str, Any]) -> str:
    lines = ["| routing | prefix hit rate | output tok/s | TTFT median (ms) | TTFT p99 (ms) |",
             "|---|---:|---:|---:|---:|"]
    for policy in POLICIES:
        s = summary[policy]
        lines.append(f"| {policy} | {100 * s['hit_rate']:.1f} % | {s['output_throughput']:.1f} | "
                     f"{s['median_ttft_ms']:.0f} | {s['p99_ttft_ms']:.0f} |")
    lines.append(f"\nthroughput prefix / load: {summary['throughput_ratio']:.2f}x (goal >= {GOAL}x)")
    return "\n".join(lines)
