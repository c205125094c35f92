"""``gridserve bench expert-parallel``: served decode of a Qwen3-MoE shape, DP = 2 with expert
parallelism against DP = 2 without it (every engine holding every expert).

    gridserve bench expert-parallel                                  # the lead's quiet run
    gridserve bench expert-parallel --layers 2 --experts 8 --hidden 128 --num-prompts 4 \\
        --output-lens 8                                              # a smoke run

The model is a random Qwen3-MoE checkpoint (``Qwen3MoeForCausalLM``, built with transformers' own
class and the recipe's tokenizer, cached under ``<model cache>/ep-bench/``): Qwen3-30B-A3B's shape
scaled down, 64 experts, top 8, hidden 512, expert intermediate 256, 8 query / 4 KV heads of 64,
4 layers, vocab 4,096 (every size a flag). Each layout is a fresh ``gridserve serve MODEL
--data-parallel-size 2`` (``--enable-expert-parallel`` for ``ep``), started and stopped as ``bench
served-ab`` does (its log kept in ``--log-dir``); the load is ``bench default-model``'s served W
client: ``--num-prompts`` random-token requests all at once (prompts ``--input-lens``, outputs
``--output-lens`` tokens, ``ignore_eos``, greedy), after one warm-up request. One run per layout,
``no-ep`` first (``--quantization int8``: both quantized). Per layout: output tok/s, median TPOT and TTFT, and the expert parameter bytes
each worker reports; then the EP / no-EP ratios.

What to expect: EP halves each worker's expert bytes, and every MoE layer then exchanges its
tokens between the engines (all-gather + all-reduce over gloo on CPU, ``services/worker/fused_moe.py``),
so each decode step pays collectives the no-EP layout does not; the engines also step in lockstep
in both layouts (MoE waves).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from gridserve.benchmarks import harness

logger = logging.getLogger(__name__)

LAYOUTS = {"no-ep": [], "ep": ["--enable-expert-parallel"]}
CACHE_FOLDER = "ep-bench"
VOCAB = 4096
_EXPERT_BYTES = re.compile(r"experts \[(\d+), (\d+)\) of (\d+) per MoE layer, expert parameter bytes (\d+)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--moe-intermediate", type=int, default=256, help="each expert's intermediate size")
    parser.add_argument("--heads", type=int, default=8, help="query heads (head dim 64; half as many KV heads)")
    parser.add_argument("--num-prompts", type=int, default=64, help="requests, all submitted at once")
    parser.add_argument("--input-lens", default="32-64", metavar="MIN-MAX")
    parser.add_argument("--output-lens", default="64-128", metavar="MIN-MAX")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=256 << 20, help="per engine")
    parser.add_argument("--quantization", choices=["int8", "int4"], default=None,
                        help="serve both layouts quantized (the experts too: only each worker's own under EP)")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds a start or a request may take")
    parser.add_argument("--log-dir", default=None, help="each server's log (default: a new temp folder, kept)")
    parser.add_argument("--output-json", default=None, help="write the results here")


def model_config(args: argparse.Namespace) -> dict[str, Any]:
    """The Qwen3-MoE config the flags describe."""
    if args.hidden % args.heads or args.heads % 2 or args.experts % 2:
        raise ValueError("--hidden must divide by --heads, and --heads and --experts must be even")
    return {"hidden_size": args.hidden, "num_hidden_layers": args.layers, "num_attention_heads": args.heads,
            "num_key_value_heads": args.heads // 2, "head_dim": 64, "num_experts": args.experts,
            "num_experts_per_tok": args.top_k, "moe_intermediate_size": args.moe_intermediate,
            "intermediate_size": 3 * args.moe_intermediate, "norm_topk_prob": True,
            "max_position_embeddings": max(args.max_model_len, 512), "tie_word_embeddings": False,
            "vocab_size": VOCAB}


def ensure_model(config: dict[str, Any]) -> Path:
    """The cached random Qwen3-MoE checkpoint of ``config`` (built on first use)."""
    from gridserve.demo import recipe

    cache = recipe.default_cache_dir()
    tokenizer = recipe.ensure_tokenizer(VOCAB, cache)
    key = "-".join(f"{config[k]}" for k in ("num_hidden_layers", "hidden_size", "num_experts",
                                             "num_experts_per_tok", "moe_intermediate_size",
                                             "num_attention_heads", "max_position_embeddings"))
    return recipe._ensure(cache / CACHE_FOLDER / f"qwen3-moe-{key}", lambda out: _build(out, config, tokenizer),
                          {"ep_bench": config})


def _build(out: Path, config: dict[str, Any], tokenizer: Path) -> None:
    import torch
    import transformers

    from gridserve.demo import recipe

    special = {"bos_token_id": recipe.BOS_ID, "eos_token_id": recipe.EOS_ID, "pad_token_id": recipe.PAD_ID}
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(**special, **config),
                                                          dtype=torch.float32).eval()
    model.save_pretrained(out, safe_serialization=True)
    for path in tokenizer.iterdir():
        if path.is_file() and path.name != recipe.MARKER:
            shutil.copy(path, out / path.name)


def _expert_bytes(log: Path) -> list[int]:
    """The expert parameter bytes each worker logged (``--log-dir``'s ``worker-*.log``)."""
    found = []
    for path in sorted(log.glob("worker-*.log")):
        match = _EXPERT_BYTES.search(path.read_text(errors="replace"))
        if match:
            found.append(int(match[4]))
    return found


def run(args: argparse.Namespace) -> int:
    from gridserve.benchmarks.default_model_bench import _served_w
    from gridserve.benchmarks.served_ab import logged_server

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx2").setLevel(logging.WARNING)
    model = str(ensure_model(model_config(args)))
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="gridserve-ep-bench-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    logger.info("model %s; server logs: %s", model, log_dir)
    w_args = argparse.Namespace(num_prompts=args.num_prompts, input_lens=args.input_lens,
                                output_lens=args.output_lens, timeout=args.timeout)
    common = ["--data-parallel-size", "2", "--max-model-len", str(args.max_model_len),
              "--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes)]
    if args.quantization:
        common += ["--quantization", args.quantization]
    result: dict[str, Any] = {"benchmark": "expert-parallel", "model": model, "config": model_config(args),
                              "cpus": os.cpu_count(), "workload": vars(w_args), "serve_args": common,
                              "log_dir": str(log_dir), "runs": {}}
    for layout in args.layouts:
        roles = log_dir / layout
        roles.mkdir(exist_ok=True)
        load = os.getloadavg()[0]
        logger.info("%s: gridserve serve %s, load %.2f", layout, " ".join(common + LAYOUTS[layout]), load)
        extra = [*common, *LAYOUTS[layout], "--log-dir", str(roles)]
        with logged_server(sys.executable, model, extra, log_dir / f"serve-{layout}.log", args.timeout) as url:
            w = _served_w(url, model, w_args)
        row = {"output_tok_s": round(w["output_throughput"], 1), "median_tpot_ms": round(w["median_tpot_ms"], 2),
               "median_ttft_ms": round(w["median_ttft_ms"], 1), "completed": w["completed"], "failed": w["failed"],
               "expert_bytes_per_worker": _expert_bytes(roles), "load_avg_at_start": round(load, 2)}
        result["runs"][layout] = row
        logger.info("  %.1f output tok/s, TPOT %.2f ms, TTFT %.0f ms (%d completed, %d failed); expert bytes "
                    "per worker %s", row["output_tok_s"], row["median_tpot_ms"], row["median_ttft_ms"],
                    row["completed"], row["failed"], row["expert_bytes_per_worker"])
    result["summary"] = _summary(result["runs"])
    print(json.dumps(result, indent=2))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def _summary(runs: dict[str, dict]) -> dict[str, Any]:
    if not {"ep", "no-ep"} <= runs.keys():
        return {}
    ep, plain = runs["ep"], runs["no-ep"]
    summary = {"output_tok_s_ep_over_no_ep": round(ep["output_tok_s"] / plain["output_tok_s"], 3),
               "median_tpot_ep_over_no_ep": round(ep["median_tpot_ms"] / plain["median_tpot_ms"], 3)}
    if ep["expert_bytes_per_worker"] and plain["expert_bytes_per_worker"]:
        summary["expert_bytes_ep_over_no_ep"] = round(statistics.mean(ep["expert_bytes_per_worker"])
                                                      / statistics.mean(plain["expert_bytes_per_worker"]), 3)
    return summary


def main(argv: list[str] | None = None) -> int:
    return harness.standalone(__doc__, add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
