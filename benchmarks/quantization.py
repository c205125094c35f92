"""``gridserve bench quantization``: accuracy and memory of every weight / KV-cache mode against
fp32, on the same model and held-out text, in one run.

Per mode: mean KL divergence (nats) of the next-token distributions against fp32 over a held-out
text (teacher forcing: the fp32 and the quantized model read the same tokens), greedy agreement
(share of the first ``--greedy-tokens`` greedily generated tokens equal to fp32's, position by
position, over several prompts), held-out perplexity, bytes of weights and KV tokens per GiB.
The bars are the issue's: 16-bit KV KL <= 0.005; int8 KL <= 0.02 and agreement >= 0.9; fp8 KV
KL <= 0.05; int4 KL <= 0.15.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from gridserve.benchmarks.throughput import add_workload_arguments

logger = logging.getLogger(__name__)

MODES: dict[str, dict[str, Any]] = {
    "fp32": {},
    "kv-bf16": {"kv_cache_dtype": "bfloat16"},
    "bf16": {"dtype": "bfloat16"},  # bf16 weights and KV cache: vLLM's CPU precision (no bar: reported)
    "kv-fp16": {"kv_cache_dtype": "float16"},
    "kv-fp8_e4m3": {"kv_cache_dtype": "fp8_e4m3"},
    "kv-fp8_e5m2": {"kv_cache_dtype": "fp8_e5m2"},
    "int8": {"quantization": "int8"},
    "int8+kv-bf16": {"quantization": "int8", "kv_cache_dtype": "bfloat16"},
    "int8+kv-fp16": {"quantization": "int8", "kv_cache_dtype": "float16"},
    "int8-weight-only": {"quantization_config": {"method": "int8", "weight_only": True}},
    "int8-fp32-head": {"quantization_config": {"method": "int8", "ignore": ["lm_head"]}},
    "int8-g32": {"quantization_config": {"method": "int8", "activation_group": 32}},
    "int8-g32+kv-bf16": {"quantization_config": {"method": "int8", "activation_group": 32},
                         "kv_cache_dtype": "bfloat16"},
    "int8-g32+kv-fp16": {"quantization_config": {"method": "int8", "activation_group": 32},
                         "kv_cache_dtype": "float16"},
    "int8-1row": {"quantization_config": {"method": "int8", "activation_rows": 1}},
    "int8-1row+kv-bf16": {"quantization_config": {"method": "int8", "activation_rows": 1},
                          "kv_cache_dtype": "bfloat16"},
    "int4": {"quantization": "int4"},
    "int4+kv-fp8": {"quantization": "int4", "kv_cache_dtype": "fp8_e4m3"},
}
# mode -> (max mean KL in nats, min greedy agreement or None)
BARS: dict[str, tuple[float, Optional[float]]] = {
    "kv-bf16": (0.005, None),
    "kv-fp16": (0.005, None),
    "kv-fp8_e4m3": (0.05, None),
    "kv-fp8_e5m2": (0.05, None),
    "int8": (0.02, 0.9),
    "int8+kv-bf16": (0.02, 0.9),
    "int8+kv-fp16": (0.02, 0.9),
    "int8-weight-only": (0.02, 0.9),
    "int8-fp32-head": (0.02, 0.9),
    "int8-g32": (0.02, 0.9),
    "int8-g32+kv-bf16": (0.02, 0.9),
    "int8-g32+kv-fp16": (0.02, 0.9),
    "int8-1row": (0.02, 0.9),
    "int8-1row+kv-bf16": (0.02, 0.9),
    "int4": (0.15, None),
}
DEFAULT_OUTPUT_JSON = str(Path(__file__).parent / "results" / "quantization.json")


@dataclass
class ModeResult:
    mode: str
    mean_kl: float
    greedy_agreement: float  # free-running: generated tokens equal to fp32's, position by position
    argmax_agreement: float  # teacher-forced: same next-token argmax as fp32 on the held-out text
    perplexity: float
    weight_bytes: int
    kv_tokens_per_gib: int
    passes: Optional[bool]


def _model_of(llm: Any) -> Any:
    return llm.llm_engine.core.executor.worker.runner.model


def teacher_forced_logprobs(llm: Any, token_ids: list[int]) -> Any:
    """Log-softmax of the next-token logits at every position of ``token_ids`` ([n, vocab]).

    Captures the logits the worker computes for prompt logprobs (and the last position's sample)
    in the in-process worker: the engine's own forward pass, paged cache and kernels included.
    """
    import torch

    from gridserve import SamplingParams

    model = _model_of(llm)
    captured: list[torch.Tensor] = []
    original = model.compute_logits

    def capture(hidden: torch.Tensor) -> torch.Tensor:
        logits = original(hidden)
        captured.append(logits.float().cpu())
        return logits

    model.compute_logits = capture
    try:
        llm.generate(
            [{"prompt_token_ids": token_ids}],
            SamplingParams(max_tokens=1, prompt_logprobs=0),
            use_tqdm=False,
        )
    finally:
        del model.compute_logits
    return torch.log_softmax(torch.cat(captured), dim=-1)


def greedy_tokens(llm: Any, prompts: list[list[int]], n: int) -> list[list[int]]:
    from gridserve import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]


def mean_kl(reference: Any, other: Any) -> float:
    """Mean over positions of KL(reference || other), both log-probabilities [n, vocab]."""
    return float((reference.exp() * (reference - other)).sum(-1).mean())


def perplexity(logprobs: Any, token_ids: list[int]) -> float:
    import torch

    targets = torch.tensor(token_ids[1:])
    nll = -logprobs[: len(targets)].gather(1, targets[:, None]).mean()
    return math.exp(float(nll))


def agreement(reference: list[list[int]], other: list[list[int]]) -> float:
    same = sum(a == b for ref, out in zip(reference, other) for a, b in zip(ref, out))
    return same / max(sum(len(r) for r in reference), 1)


def weight_bytes(llm: Any) -> int:
    from gridserve.services.worker.loader import parameter_bytes

    return parameter_bytes(_model_of(llm))


def evaluate(
    model: str,
    text_ids: list[int],
    prompts: list[list[int]],
    modes: list[str],
    greedy: int = 64,
    **llm_kwargs: Any,
) -> list[ModeResult]:
    """Every mode of ``modes`` against fp32, one model loaded at a time."""
    from gridserve import LLM

    results: list[ModeResult] = []
    reference = ref_tokens = None
    for mode in ["fp32"] + [m for m in modes if m != "fp32"]:
        llm = LLM(model, **MODES[mode], **llm_kwargs)
        try:
            logprobs = teacher_forced_logprobs(llm, text_ids)
            tokens = greedy_tokens(llm, prompts, greedy)
            per_token = llm.llm_engine.core.config.kv_bytes_per_token_per_rank()
            if reference is None:
                reference, ref_tokens = logprobs, tokens
            kl, agree = mean_kl(reference, logprobs), agreement(ref_tokens, tokens)
            bar = BARS.get(mode)
            passes = None if bar is None else kl <= bar[0] and (bar[1] is None or agree >= bar[1])
            results.append(
                ModeResult(
                    mode,
                    kl,
                    agree,
                    float((reference.argmax(-1) == logprobs.argmax(-1)).float().mean()),
                    perplexity(logprobs, text_ids),
                    weight_bytes(llm),
                    2**30 // per_token,
                    passes,
                )
            )
            logger.info("%s: KL %.5f, agreement %.3f", mode, kl, agree)
        finally:
            llm.shutdown()
    return results


def held_out_text(max_chars: int = 60_000) -> str:
    """Text the model was not trained on: the demo corpus's held-out stdlib files when this checkout
    has them (``gridserve.demo.corpus.heldout_files``), else this repo's docs (out of domain)."""
    try:
        from gridserve.demo import corpus
    except ImportError:
        corpus = None
    if corpus is not None and hasattr(corpus, "heldout_files"):
        text = "\n\n".join(corpus.read_text(p) for p in corpus.heldout_files()[:8])
        if text.strip():
            return text[:max_chars]
    root = Path(__file__).resolve().parent.parent
    return "\n\n".join(p.read_text(encoding="utf-8") for p in sorted((root / "docs").glob("*.md")))


SPEED_MODES = ("fp32", "int8+kv-bf16", "int8", "kv-bf16", "int4+kv-fp8")


def add_speed_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="HF folder (default: the recipe's llama small)"
    )
    parser.add_argument(
        "--modes", default=",".join(SPEED_MODES), help="comma-separated modes; fp32 first"
    )
    add_workload_arguments(parser)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument(
        "--output-json", default=str(Path(__file__).parent / "results" / "quantization_speed.json")
    )


def run_speed(args: argparse.Namespace) -> int:
    """Offline throughput of W per mode, one run each, as a ratio to fp32 in the same run."""
    from gridserve.benchmarks import throughput
    from gridserve.demo.recipe import ensure_checkpoint

    model = args.model or str(ensure_checkpoint("llama", "small"))
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    workload = throughput.make_workload(
        args.num_prompts,
        args.input_len_min,
        args.input_len_max,
        args.output_len_min,
        args.output_len_max,
        vocab,
        args.seed,
    )
    kv_bytes = throughput.kv_cache_bytes_for(workload, model)  # the fp32 need: every mode fits
    rows = []
    for mode in [m for m in args.modes.split(",") if m]:
        result = throughput.run_gridserve(
            model,
            workload,
            kv_cache_memory_bytes=kv_bytes,
            name=mode,
            device=args.device,
            **MODES[mode],
        )
        rows.append(
            {
                "mode": mode,
                "elapsed_s": result.elapsed_s,
                "tok_per_s": result.output_tok_per_s,
                "cpu_s": result.cpu_s,
                "load_avg": result.load_avg,
            }
        )
    base = rows[0]["tok_per_s"]
    print(f"W offline ({workload.num_requests} requests, {Path(model).name}), one run each:")
    print(f"{'mode':<14} {'tok/s':>8} {'vs ' + rows[0]['mode']:>9} {'load avg':>12}")
    for r in rows:
        r["ratio"] = r["tok_per_s"] / base
        print(
            f"{r['mode']:<14} {r['tok_per_s']:>8.1f} {r['ratio']:>8.2f}x {str(r['load_avg']):>12}"
        )
    Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output_json).write_text(
        json.dumps({"model": model, "workload": workload.describe(), "results": rows}, indent=2)
    )
    return 0


def add_step_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="HF folder (default: the recipe's llama base)"
    )
    parser.add_argument(
        "--modes", default="fp32,int8+kv-bf16,int8,kv-bf16", help="comma-separated modes"
    )
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--context", type=int, default=250, help="prompt tokens per request")
    parser.add_argument("--steps", type=int, default=10, help="decode steps measured")
    parser.add_argument(
        "--output-json", default=str(Path(__file__).parent / "results" / "quantization_step.json")
    )


def memory_bandwidth(nbytes: int = 1 << 29, repeats: int = 5) -> float:
    """Bytes per second a large tensor copy moves (read + written), best of ``repeats``."""
    import time

    import torch

    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


def decode_step(model: str, mode: str, batch: int, context: int, steps: int) -> dict[str, Any]:
    """Median decode-step time at ``batch`` running requests of ``context`` tokens, and the bytes
    the step must read: every weight once plus every request's KV cache."""
    import random
    import statistics
    import time

    from gridserve import LLM, SamplingParams

    llm = LLM(model, max_num_seqs=batch, kv_cache_memory_bytes=2 << 30, **MODES[mode])
    try:
        engine = llm.llm_engine
        rng = random.Random(0)
        vocab = engine.config.model.vocab_size
        params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
        for i in range(batch):
            engine.add_request(
                {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(context)]},
                params,
                str(i),
            )
        scheduler = engine.core.scheduler
        while scheduler.waiting or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running
        ):
            engine.step()
        engine.step()  # warm-up
        walls = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - start)
        kv_tokens = sum(r.num_computed_tokens for r in scheduler.running)
        kv_bytes = kv_tokens * engine.core.config.kv_bytes_per_token_per_rank()
        weights = weight_bytes(llm)
    finally:
        llm.shutdown()
    return {
        "mode": mode,
        "median_step_ms": statistics.median(walls) * 1e3,
        "weight_bytes": weights,
        "kv_bytes": kv_bytes,
    }


def run_step(args: argparse.Namespace) -> int:
    """Decode step per mode against its bandwidth floor (bytes to read / measured bandwidth)."""
    from gridserve.demo.recipe import ensure_checkpoint

    model = args.model or str(ensure_checkpoint("llama", "base"))
    bandwidth = memory_bandwidth()
    rows = [
        decode_step(model, mode, args.batch_size, args.context, args.steps)
        for mode in args.modes.split(",")
        if mode
    ]
    print(
        f"decode step, batch {args.batch_size}, ~{args.context} tokens of context, "
        f"copy bandwidth {bandwidth / 1e9:.1f} GB/s:"
    )
    print(
        f"{'mode':<14} {'step ms':>8} {'weights MB':>11} {'KV MB':>8} {'floor ms':>9} {'floor/step':>10}"
    )
    for r in rows:
        r["floor_ms"] = (r["weight_bytes"] + r["kv_bytes"]) / bandwidth * 1e3
        r["floor_share"] = r["floor_ms"] / r["median_step_ms"]
        print(
            f"{r['mode']:<14} {r['median_step_ms']:>8.1f} {r['weight_bytes'] / 1e6:>11.1f} "
            f"{r['kv_bytes'] / 1e6:>8.1f} {r['floor_ms']:>9.1f} {r['floor_share']:>9.0%}"
        )
    Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output_json).write_text(
        json.dumps({"model": model, "bandwidth_bytes_per_s": bandwidth, "results": rows}, indent=2)
    )
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="HF folder (default: the recipe's llama small)"
    )
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated modes")
    parser.add_argument("--tokens", type=int, default=512, help="held-out tokens scored")
    parser.add_argument("--text-file", default=None, help="held-out text (default: see held_out_text)")
    parser.add_argument("--greedy-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=16, help="greedy prompts")
    parser.add_argument("--max-model-len", type=int, default=2048,
                        help="context per sequence (long-context models: their 256 MiB KV cache holds it)")
    parser.add_argument("--output-json", default=DEFAULT_OUTPUT_JSON)


def run(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from gridserve.demo.recipe import ensure_checkpoint

    model = args.model or str(ensure_checkpoint("llama", "small"))
    text = Path(args.text_file).read_text(encoding="utf-8") if args.text_file else held_out_text()
    ids = AutoTokenizer.from_pretrained(model)(text)["input_ids"]
    text_ids = ids[: args.tokens]
    prompts = [ids[args.tokens + 32 * i : args.tokens + 32 * i + 32] for i in range(args.prompts)]
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"--modes: unknown {unknown}; known: {list(MODES)}")
    results = evaluate(
        model,
        text_ids,
        prompts,
        modes,
        args.greedy_tokens,
        kv_cache_memory_bytes=2**28,
        max_model_len=args.max_model_len,
    )
    print(
        f"{'mode':<16} {'mean KL':>9} {'greedy':>7} {'argmax':>7} {'ppl':>8} {'weights MiB':>12} "
        f"{'KV tok/GiB':>11} bar"
    )
    for r in results:
        bar = "-" if r.passes is None else ("pass" if r.passes else "FAIL")
        print(
            f"{r.mode:<16} {r.mean_kl:>9.5f} {r.greedy_agreement:>7.3f} {r.argmax_agreement:>7.3f} "
            f"{r.perplexity:>8.2f} "
            f"{r.weight_bytes / 2**20:>12.1f} {r.kv_tokens_per_gib:>11} {bar}"
        )
    Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output_json).write_text(
        json.dumps({"model": model, "results": [asdict(r) for r in results]}, indent=2)
    )
    return 0
