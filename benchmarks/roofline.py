"""``gridserve bench roofline``: the fastest workload W could run on this machine, per precision.

    gridserve bench roofline                                    # the default model, W's expected tokens
    gridserve bench roofline --peer-json benchmarks/results/peer_vllm.json --output-json roofline.json

W (256 requests at once, prompts 64-256 tokens, outputs 32-256) is mostly GEMMs: every prompt and
output token goes through each decoder layer's projections (QKV, O, gate/up, down) and every
sampled token through the LM head. This counts W's FLOPs on the model's shape (the token totals
of a ``bench peer`` run when given, else the ranges' expectations), measures the best GEMM rate
this machine reaches at W's shapes in each precision, and divides:

- **FLOPs**: ``2 x rows x in x out`` per projection and per LM-head row (prefill: the last prompt
  token of each request; decode: every other output token), plus attention's ``4 x context x
  heads x head_dim`` per token and layer (context averaged over the uniform ranges).
- **GEMM rate**: per layer shape at ``--rows`` rows (W's decode batch and a prefill chunk), the
  fastest of the implementations this build has for the precision — fp32: ``F.linear`` (MKL) and
  the oneDNN-packed weight gridserve runs; bf16: the same two in bf16 (packed only with native
  bf16); int8: gridserve's C++ kernel with 16-bit activations (the default) and with int8
  activations per 32 columns (``activation_group`` 32). Each is the fastest of ``--repeats`` calls
  on every thread (wall time); the rate for the precision is W's FLOP mix over the time those
  GEMMs take at their best.
- **Floor**: W's GEMM FLOPs / that rate — a bound no server beats at this precision on this
  machine with these kernels (attention, norms, sampling and serving are left out, so the real
  floor is higher). With ``--peer-json``: each measured server's output tok/s against the floor,
  and the rate a target of ``--target`` x vLLM would need.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from gridserve.benchmarks.peer_report import parse_range
from gridserve.benchmarks.step_model import DecoderShape

logger = logging.getLogger(__name__)

PRECISIONS = ("fp32", "bf16", "int8")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF folder (default: the default model as an HF folder)")
    parser.add_argument("--peer-json", default=None,
                        help="a bench peer JSON: W's token totals and each server's tok/s")
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-lens", default="64-256", metavar="MIN-MAX")
    parser.add_argument("--output-lens", default="32-256", metavar="MIN-MAX")
    parser.add_argument("--rows", default="256,512", help="GEMM row counts probed, comma separated")
    parser.add_argument("--repeats", type=int, default=25, help="calls per GEMM (the fastest counts)")
    parser.add_argument("--target", type=float, default=2.0, help="the ratio over vLLM to check")
    parser.add_argument("--output-json", default=None)


def _mean_sq(lo: int, hi: int) -> float:
    return statistics.fmean(n * n for n in range(lo, hi + 1))


def workload_flops(shape: DecoderShape, num_prompts: int, input_lens: tuple[int, int],
                   output_lens: tuple[int, int], prompt_tokens: Optional[int] = None,
                   output_tokens: Optional[int] = None) -> dict[str, float]:
    """W's FLOPs by part: ``projections`` (decoder layers' GEMMs), ``lm_head`` and ``attention``."""
    mean_in, mean_out = sum(input_lens) / 2, sum(output_lens) / 2
    prompt_tokens = prompt_tokens if prompt_tokens is not None else round(num_prompts * mean_in)
    output_tokens = output_tokens if output_tokens is not None else round(num_prompts * mean_out)
    tokens = prompt_tokens + max(output_tokens - num_prompts, 0)  # the last output token is never fed back
    projections = 2.0 * shape.projection_params() * tokens
    lm_head = 2.0 * shape.hidden * shape.vocab * output_tokens
    per_ctx = 4.0 * shape.heads * shape.head_dim * shape.layers  # QK^T and PV per context token
    prefill_ctx = num_prompts * _mean_sq(*input_lens) / 2  # sum over prompts of p^2 / 2
    decode_ctx = num_prompts * mean_out * (mean_in + mean_out / 2)
    return {"projections": projections, "lm_head": lm_head, "attention": per_ctx * (prefill_ctx + decode_ctx),
            "prompt_tokens": prompt_tokens, "output_tokens": output_tokens}


def _fastest_s(fn: Callable[[], Any], repeats: int) -> float:
    """The fastest of ``repeats`` calls (wall time): a bound wants the machine's best, and on a shared
    VM single calls stall for a scheduler tick (~15 ms) now and then, whatever their size."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _implementations(precision: str, weight, rows: int) -> dict[str, Callable[[], Any]]:
    """The ways this build multiplies ``rows`` activations by ``weight`` [out, in] in ``precision``."""
    import torch
    import torch.nn.functional as F

    from gridserve.services.worker import cpu_packed_linear
    from gridserve.services.worker.quantization.weights import Int8Weight

    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, weight.shape[1], generator=gen)
    if precision == "int8":
        int16, group32 = Int8Weight.from_float(weight), Int8Weight.from_float(weight, activation_group=32)
        return {"int8-int16-activations": lambda: int16(x), "int8-group32-activations": lambda: group32(x)}
    dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    w, xd = weight.to(dtype), x.to(dtype)
    found = {f"{precision}-F.linear": lambda: F.linear(xd, w)}
    if cpu_packed_linear.available() and cpu_packed_linear.packable(w):
        packed = cpu_packed_linear.pack(w)
        found[f"{precision}-onednn-packed"] = lambda: cpu_packed_linear.linear(xd, packed)
    return found


def gemm_rates(shape: DecoderShape, rows: list[int], repeats: int) -> dict[str, Any]:
    """Per precision: the best implementation's seconds per shape and row count, and the rate (FLOP/s)
    of W's mix (each layer matrix weighted by its count, the LM head once) at those bests."""
    import torch

    gen = torch.Generator().manual_seed(0)
    matrices = {f"{i}x{o}": (i, o, shape.layers) for i, o in shape.layer_matrices()}
    matrices[f"lm_head {shape.hidden}x{shape.vocab}"] = (shape.hidden, shape.vocab, 1)
    result: dict[str, Any] = {}
    for precision in PRECISIONS:
        flops = seconds = 0.0
        per_shape = []
        for name, (k, n, count) in matrices.items():
            weight = torch.randn(n, k, generator=gen) * 0.05
            for m in rows:
                times = {impl: _fastest_s(fn, repeats) for impl, fn in _implementations(precision, weight, m).items()}
                best = min(times, key=times.get)
                per_shape.append({"matrix": name, "rows": m, "best": best,
                                  "gflops": {impl: 2e-9 * m * k * n / t for impl, t in times.items()}})
                flops += 2.0 * m * k * n * count
                seconds += times[best] * count
        result[precision] = {"rate_flops": flops / seconds, "shapes": per_shape}
    return result


def _peer_servers(peer: dict[str, Any]) -> list[dict[str, Any]]:
    """(variant name, server, pair, output tok/s) of every run in a bench peer JSON (every round)."""
    rounds = peer.get("rounds") or [peer]
    out = []
    for r in rounds:
        for v in r.get("variants", []):
            run = v.get("run") or {}
            if run.get("completed"):
                out.append({"name": v["variant"]["name"], "server": v["variant"]["server"],
                            "pair": v["variant"]["pair"], "tok_s": run["output_throughput"]})
    return out


def report(flops: dict[str, float], rates: dict[str, Any], peer: Optional[dict[str, Any]],
           target: float) -> dict[str, Any]:
    """Per precision: GEMM rate, W's GEMM floor in seconds and output tok/s; with a peer JSON each
    server's median tok/s over the floor, and the rate ``target`` x vLLM would need."""
    gemm = flops["projections"] + flops["lm_head"]
    rows: dict[str, Any] = {}
    servers = _peer_servers(peer) if peer else []
    for precision in PRECISIONS:
        rate = rates[precision]["rate_flops"]
        floor_s = gemm / rate
        row = {"gemm_gflops_per_s": rate / 1e9, "w_gemm_tflop": gemm / 1e12, "floor_s": floor_s,
               "max_output_tok_s": flops["output_tokens"] / floor_s}
        vllm_pair = {"int8": "bf16"}.get(precision, precision)  # int8 is held to vLLM bf16 (peer_report)
        for s in servers:
            if s["server"] == "gridserve" and s["pair"] == precision:
                row.setdefault("gridserve", {}).setdefault(s["name"], []).append(s["tok_s"])
            if s["server"] == "vllm" and s["pair"] == vllm_pair:
                row.setdefault("vllm", []).append(s["tok_s"])
        for name, values in row.get("gridserve", {}).items():
            row["gridserve"][name] = {"tok_s": statistics.median(values),
                                      "of_max": statistics.median(values) / row["max_output_tok_s"]}
        if row.get("vllm"):
            vllm = statistics.median(row["vllm"])
            needed_s = flops["output_tokens"] / (target * vllm)
            row["vllm"] = {"tok_s": vllm, "target_tok_s": target * vllm, "target_s": needed_s,
                           "target_needs_gemm_gflops_per_s": gemm / needed_s / 1e9,
                           "target_over_max": target * vllm / row["max_output_tok_s"]}
        rows[precision] = row
    return rows


def format_report(rows: dict[str, Any], target: float) -> str:
    lines = [f"{'precision':<10}{'GEMM GF/s':>10}{'floor s':>9}{'max tok/s':>10}  measured (of max)"
             f"{'':>6}vLLM tok/s  {target:g}x needs"]
    for precision, r in rows.items():
        measured = ", ".join(f"{n} {v['tok_s']:.0f} ({v['of_max']:.0%})" for n, v in r.get("gridserve", {}).items())
        vllm = r.get("vllm")
        needs = (f"{vllm['tok_s']:>9.0f}  {vllm['target_tok_s']:.0f} tok/s = {vllm['target_over_max']:.2f}x max"
                 if vllm else "")
        lines.append(f"{precision:<10}{r['gemm_gflops_per_s']:>10.0f}{r['floor_s']:>9.1f}"
                     f"{r['max_output_tok_s']:>10.0f}  {measured or '-':<28}{needs}")
    return "\n".join(lines)


def _model_path(model: Optional[str]) -> Path:
    if model:
        return Path(model)
    from gridserve.benchmarks.peer import smollm2_hf_folder  # the default model as an HF folder

    return smollm2_hf_folder()


def run(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoConfig

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        peer = json.loads(Path(args.peer_json).read_text()) if args.peer_json else None
    except (OSError, ValueError) as exc:
        raise SystemExit(f"--peer-json: cannot read a bench peer JSON from {args.peer_json!r}: {exc}") from None
    totals: dict[str, Optional[int]] = {"prompt_tokens": None, "output_tokens": None}
    model = args.model
    if peer:
        first = (peer.get("rounds") or [peer])[0]
        workload = first.get("workload", {})
        totals = {"prompt_tokens": workload.get("total_prompt_tokens"),
                  "output_tokens": workload.get("total_output_tokens")}
        model = model or first.get("model")
    path = _model_path(model)
    shape = DecoderShape.from_hf(AutoConfig.from_pretrained(path))
    input_lens = parse_range(args.input_lens, "--input-lens")
    output_lens = parse_range(args.output_lens, "--output-lens")
    flops = workload_flops(shape, args.num_prompts, input_lens, output_lens, **totals)
    try:
        rows = [int(r) for r in args.rows.split(",") if r.strip()]
    except ValueError:
        rows = []
    if not rows or min(rows) < 1 or args.repeats < 1:
        raise SystemExit(f"--rows: positive row counts, comma separated (got {args.rows!r}); "
                         f"--repeats >= 1 (got {args.repeats})")
    load_start = os.getloadavg()[0]
    rates = gemm_rates(shape, rows, args.repeats)
    table = report(flops, rates, peer, args.target)
    result = {"benchmark": "roofline", "model": str(path), "shape": vars(shape), "threads": torch.get_num_threads(),
              "load_avg": [load_start, os.getloadavg()[0]], "workload_flops": flops, "rows": rows,
              "gemm": rates, "report": table, "target": args.target}
    print(format_report(table, args.target))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2))
    return 0
