"""``gridserve bench bf16``: bf16 weights on the CPU (issue 40) against fp32, in one run.

    gridserve bench bf16                              # both parts, the default model (SmolLM2)
    gridserve bench bf16 --part linear --repeats 15   # the GEMMs alone
    gridserve bench bf16 --part offline --profile 25  # offline throughput + a bf16 profile

**linear**: per layer shape of SmolLM2-135M (fused QKV 576->960, o_proj 576->576, fused gate/up
576->3072, down 1536->576, the tied LM head 576->49152) and per row count, the median
milliseconds of fp32 ``F.linear``, fp32 through oneDNN's packed weight (``cpu_packed_linear``),
bf16 ``F.linear`` and bf16 packed. The calls are interleaved round by round, so load on a shared
machine hits them alike.

**offline**: ``LLM.generate`` on ``--num-prompts`` prompts of ``--input-len`` random tokens, greedy,
``ignore_eos``, per configuration: ``fp32`` (packed linears, the default), ``bf16-plain``
(``GRIDSERVE_CPU_PACKED_LINEAR=0``: torch's bf16 ``F.linear``, what ``--dtype bfloat16`` ran
before bf16 weights were packed) and ``bf16`` (packed, where the CPU has native bf16). Each is
timed with one output token (prefill) and with ``--output-len`` (prefill + decode); decode
throughput is the extra tokens over the extra time. Rounds alternate the configurations; the
medians are reported. ``--profile N``: the N costliest functions (own time) of one bf16 run.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import io
import json
import logging
import os
import pstats
import statistics
import time
from pathlib import Path
from typing import Any
from unittest import mock

from gridserve.benchmarks import harness

logger = logging.getLogger(__name__)

# SmolLM2-135M (hidden 576, 9 / 3 heads of 64, MLP 1536, vocab 49152): (out, in) per GEMM
SHAPES = {
    "qkv": (960, 576),
    "o_proj": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}
# offline configurations: (dtype, GRIDSERVE_CPU_PACKED_LINEAR)
CONFIGS = {"fp32": ("float32", "1"), "bf16-plain": ("bfloat16", "0"), "bf16": ("bfloat16", "1")}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--part", choices=("linear", "offline", "both"), default="both")
    parser.add_argument(
        "--model", default=None, help="offline: model (default: the default model, SmolLM2)"
    )
    parser.add_argument(
        "--rows", default="16,64,256,2048", help="linear: row counts, comma separated"
    )
    parser.add_argument("--repeats", type=int, default=9, help="linear: samples per call (median)")
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument(
        "--rounds", type=int, default=3, help="offline: rounds over the configurations (median)"
    )
    parser.add_argument(
        "--configs", default=",".join(CONFIGS), help=f"offline: of {', '.join(CONFIGS)}"
    )
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="offline: print the N costliest functions of one bf16 run (0: none)",
    )
    parser.add_argument("--output-json", default=None, help="write the results here")


def bench_linear(rows: list[int], repeats: int) -> list[dict]:
    """Median ms of the four GEMM forms per (shape, rows)."""
    import torch
    import torch.nn.functional as F

    from gridserve.services.worker import cpu_packed_linear

    gen = torch.Generator().manual_seed(0)
    results = []
    for name, (n, k) in SHAPES.items():
        w32 = torch.randn(n, k, generator=gen) * 0.02
        w16 = w32.bfloat16()
        p32 = cpu_packed_linear.pack(w32)
        native = torch.ops.mkldnn._is_mkldnn_bf16_supported()
        p16 = torch.ops.mkldnn._reorder_linear_weight(w16, None) if native else None
        for m in rows:
            x32 = torch.randn(m, k, generator=gen)
            x16 = x32.bfloat16()
            calls = {
                "fp32": functools.partial(F.linear, x32, w32),
                "fp32_packed": functools.partial(cpu_packed_linear.linear, x32, p32),
                "bf16": functools.partial(F.linear, x16, w16),
            }
            if p16 is not None:
                calls["bf16_packed"] = functools.partial(cpu_packed_linear.linear, x16, p16)
            results.append(
                {"shape": name, "n": n, "k": k, "rows": m, **_median_ms(calls, repeats, m * n * k)}
            )
            logger.info("%s", results[-1])
    return results


def _median_ms(calls: dict, repeats: int, flops: int) -> dict[str, float]:
    inner = max(1, int(1e8 // flops))  # ~0.1-10 ms per sample
    samples = harness.interleaved(calls, repeats, inner, warmup=True)
    return {f"{name}_ms": round(statistics.median(s) * 1e3, 4) for name, s in samples.items()}


def _packing(value: str) -> contextlib.AbstractContextManager:
    """``GRIDSERVE_CPU_PACKED_LINEAR=value`` while the block runs (an LLM packs as it loads)."""
    return mock.patch.dict(os.environ, {"GRIDSERVE_CPU_PACKED_LINEAR": value})


def _timed_generate(
    llm: Any, prompts: list, max_tokens: int, profile: cProfile.Profile | None = None
) -> float:
    from gridserve import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    if profile is not None:
        profile.enable()
    llm.generate(prompts, params, use_tqdm=False)
    if profile is not None:
        profile.disable()
    return time.perf_counter() - start


def bench_offline(args: argparse.Namespace) -> dict:
    """Per configuration: median prefill and total seconds, and the throughputs from them."""
    import torch

    from gridserve import LLM
    from gridserve.default_model import default_model_file

    model = args.model or str(default_model_file())
    gen = torch.Generator().manual_seed(0)

    def fresh() -> list[dict]:  # new prompts for every call: none is a cached prefix
        return [
            {
                "prompt_token_ids": torch.randint(
                    100, 40000, (args.input_len,), generator=gen
                ).tolist()
            }
            for _ in range(args.num_prompts)
        ]

    names = [c for c in args.configs.split(",") if c]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        raise ValueError(f"--configs: unknown {unknown}; known: {', '.join(CONFIGS)}")
    llms = {}
    for name in names:
        dtype, packed = CONFIGS[name]
        with _packing(packed):
            llms[name] = LLM(
                model=model, dtype=dtype, max_num_seqs=args.num_prompts, max_model_len=1024
            )
    warm_up = fresh()
    for llm in llms.values():
        _timed_generate(llm, warm_up, 2)  # a whole batch: buffers sized, kernels built
    samples: dict[str, dict[str, list[float]]] = {
        n: {"prefill_s": [], "total_s": []} for n in names
    }
    for _ in range(args.rounds):
        prefill_prompts, total_prompts = fresh(), fresh()  # the same for every configuration
        for name in names:
            samples[name]["prefill_s"].append(_timed_generate(llms[name], prefill_prompts, 1))
            samples[name]["total_s"].append(
                _timed_generate(llms[name], total_prompts, args.output_len)
            )
    result: dict[str, Any] = {}
    for name in names:
        prefill = statistics.median(samples[name]["prefill_s"])
        total = statistics.median(samples[name]["total_s"])
        decode_tokens = args.num_prompts * (args.output_len - 1)
        result[name] = {
            "prefill_s": round(prefill, 3),
            "total_s": round(total, 3),
            "prefill_tok_s": round(args.num_prompts * args.input_len / prefill, 1),
            "decode_tok_s": round(decode_tokens / max(total - prefill, 1e-9), 1),
            "output_tok_s": round(args.num_prompts * args.output_len / total, 1),
            "samples": samples[name],
        }
        logger.info("%s: %s", name, {k: v for k, v in result[name].items() if k != "samples"})
    if args.profile and "bf16" in llms:
        profile = cProfile.Profile()
        _timed_generate(llms["bf16"], fresh(), args.output_len, profile)
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(args.profile)
        result["bf16_profile"] = text.getvalue()
        logger.info("%s", result["bf16_profile"])
    for llm in llms.values():
        llm.shutdown()
    return result


def run(args: argparse.Namespace) -> int:
    import torch

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    result: dict[str, Any] = {
        "benchmark": "bf16",
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "mkldnn_bf16": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
        "load_average_at_start": os.getloadavg()[0],
    }
    if args.part in ("linear", "both"):
        result["linear"] = bench_linear([int(r) for r in args.rows.split(",") if r], args.repeats)
    if args.part in ("offline", "both"):
        result["offline"] = bench_offline(args)
    print(json.dumps(result, indent=2))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2) + "\n")
    return 0
