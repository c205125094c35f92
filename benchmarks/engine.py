"""Engine-level figures, each from one run against its own baseline.

``gridserve bench step``   decode-step overhead: the wall time of whole engine steps (schedule,
    prepare inputs, forward, sample, update, detokenize) at a batch of B running requests, against
    the time the model's forward and LM head took inside those same steps (same batch, same
    context lengths). It also times each component of those steps (attention, MLP + projections, LM
    head, sampler, overhead) against the floor the machine sets for it (``step_model``: bytes to
    read and FLOPs to do, against the bandwidth and GEMM rate probed at start), as a table and JSON.
``gridserve bench prefix`` prefix caching: time to first token of a request whose long prefix is
    already cached, against a cold request of the same length (a fresh prefix), alternating.

Both run offline through ``LLM`` with the in-process executor (the model runner is reachable to
time its forward); the gRPC split's own cost is what ``gridserve bench executor`` measures.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any, Optional


def add_step_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF folder (default: the recipe's llama 'base')")
    parser.add_argument("--batch-size", type=int, default=64, help="running requests (B)")
    parser.add_argument("--input-len-min", type=int, default=64)
    parser.add_argument("--input-len-max", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20, help="decode steps measured")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--quantization", default=None, help="weights: int8 / int4, or a quantization config as JSON (default: as the checkpoint)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="e.g. bfloat16, float16, fp8")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                        help="default: enough for the batch at its longest context, at least 2 GiB")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after measuring, run the same steps under torch.profiler and print its top N ops")


def add_prefix_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF folder (default: the recipe's llama 'base')")
    parser.add_argument("--prefix-len", type=int, default=1024, help="shared prefix tokens")
    parser.add_argument("--suffix-len", type=int, default=32, help="distinct tokens after the prefix")
    parser.add_argument("--pairs", type=int, default=5, help="cold/warm pairs")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)


def _model_path(model: Optional[str]) -> str:
    if model is not None:
        return model
    from gridserve.demo.recipe import ensure_checkpoint

    return str(ensure_checkpoint("llama", "base"))


def _llm(model: str, kv_cache_memory_bytes: int = 2 << 30, **kwargs: Any):
    from gridserve import LLM

    return LLM(model=model, dtype="float32", kv_cache_memory_bytes=kv_cache_memory_bytes, **kwargs)


class _Timers:
    """Wraps methods of live objects (``bucket, obj, method name``) and sums the seconds spent in
    each bucket; ``remove`` puts the originals back."""

    def __init__(self, targets: list[tuple[str, Any, str]]) -> None:
        self.seconds: dict[str, float] = {bucket: 0.0 for bucket, _, _ in targets}
        self._saved = []
        for bucket, obj, name in targets:
            self._saved.append((obj, name, obj.__dict__.get(name)))
            setattr(obj, name, self._timed(bucket, getattr(obj, name)))

    def _timed(self, bucket: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[bucket] += time.perf_counter() - start
        return timed

    def remove(self) -> None:
        for obj, name, original in reversed(self._saved):
            if original is None:
                delattr(obj, name)
            else:
                setattr(obj, name, original)


def _step_timers(runner: Any) -> _Timers:
    """Seconds per step in the worker (``execute_model``), the model's forward, the attention layers
    inside it, the LM head (``compute_logits``: part of a bare forward as transformers runs it) and
    the sampler."""
    model = runner.model
    return _Timers([("worker", runner, "execute_model"), ("forward", model, "forward"),
                    ("lm_head", model, "compute_logits"), ("sampler", runner, "sampler")]
                   + [("attention", layer, "forward") for layer in model.attention_layers()])


def _components(wall: float, t: dict[str, float]) -> dict[str, float]:
    """One step's seconds per component of the step model (``overhead``: the wall time outside the
    forward, LM head and sampler; split into ``worker_other`` (input preparation, sampling
    metadata) and ``engine`` (scheduling, output processing)."""
    return {
        "attention": t["attention"], "mlp_proj": t["forward"] - t["attention"], "lm_head": t["lm_head"],
        "sampler": t["sampler"], "overhead": wall - t["forward"] - t["lm_head"] - t["sampler"],
        "worker_other": t["worker"] - t["forward"] - t["lm_head"] - t["sampler"],
        "engine": wall - t["worker"], "total": wall,
    }


def _kv_cache_bytes(args: argparse.Namespace, shape: Any) -> int:
    if args.kv_cache_memory_bytes is not None:
        return args.kv_cache_memory_bytes
    dtype = args.kv_cache_dtype
    size = 1 if "fp8" in dtype else 2 if ("16" in dtype or dtype == "half") else 4  # auto: the model's fp32
    per_token = shape.kv_elements_per_token() * size
    tokens = args.batch_size * (args.input_len_max + args.steps + 64 + 32)  # room for max_tokens and blocks
    return max(2 << 30, tokens * per_token)


def step_overhead(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoConfig

    from gridserve import SamplingParams
    from gridserve.benchmarks import step_model

    model = _model_path(args.model)
    shape = step_model.DecoderShape.from_hf(AutoConfig.from_pretrained(model))
    engine_kwargs = {"kv_cache_dtype": args.kv_cache_dtype}
    if args.quantization and args.quantization.lstrip().startswith("{"):  # a --quantization-config
        engine_kwargs["quantization_config"] = json.loads(args.quantization)
    elif args.quantization:
        engine_kwargs["quantization"] = args.quantization
    llm = _llm(model, _kv_cache_bytes(args, shape), max_num_seqs=args.batch_size, **engine_kwargs)
    engine = llm.llm_engine
    try:
        runner = engine.core.executor.worker.runner
        weights = step_model.weights_kind(runner.model)
        machine = step_model.probe(args.batch_size, shape.hidden, int8=weights == "int8")
        rng = random.Random(args.seed)
        vocab = engine.config.model.vocab_size
        params = SamplingParams(temperature=0.0, max_tokens=args.steps + 64, ignore_eos=True)
        for i in range(args.batch_size):
            length = rng.randint(args.input_len_min, args.input_len_max)
            engine.add_request({"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(length)]},
                               params, str(i))
        scheduler = engine.core.scheduler
        while scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running):
            engine.step()  # prefill everything first
        for _ in range(3):
            engine.step()  # warm-up decode steps
        timers = _step_timers(runner)
        steps: list[dict[str, float]] = []
        contexts: list[int] = []
        for i in range(args.steps):
            if i == args.steps // 2:
                contexts = [r.num_computed_tokens + 1 for r in scheduler.running]
            before = dict(timers.seconds)
            start = time.perf_counter()
            engine.step()
            wall = time.perf_counter() - start
            steps.append(_components(wall, {k: v - before[k] for k, v in timers.seconds.items()}))
        timers.remove()
        running = len(scheduler.running)
        head_alone_ms = _lm_head_matmul_ms(runner.model, len(contexts), shape.hidden)
        profile = _profile_steps(engine, args.profile) if args.profile else None
        kv_bytes = runner.kv_caches[0].element_size()
        weight_bytes = step_model.model_weight_bytes(runner.model)
    finally:
        llm.shutdown()
    walls = [s["total"] for s in steps]
    forwards = [s["attention"] + s["mlp_proj"] + s["lm_head"] for s in steps]
    ratios = [w / f for w, f in zip(walls, forwards) if f > 0]
    achieved_ms = {k: statistics.median(s[k] for s in steps) * 1e3 for k in steps[0]}
    costs = step_model.step_costs(shape, contexts, weight_bytes, kv_bytes)
    rows = step_model.report(achieved_ms, costs, machine, weights)
    results = {
        "model": model, "batch_size": args.batch_size, "running_during_measure": running, "steps": args.steps,
        "median_step_ms": statistics.median(walls) * 1e3, "median_forward_ms": statistics.median(forwards) * 1e3,
        "step_over_forward_total": sum(walls) / sum(forwards), "step_over_forward_median": statistics.median(ratios),
        "weights": weights, "kv_cache_bytes_per_element": kv_bytes, "mean_context": sum(contexts) / len(contexts),
        "probe_read_gb_s": machine.bandwidth / 1e9, "probe_gemm_fp32_gflop_s": machine.gemm_fp32 / 1e9,
        "probe_gemm_int8_gop_s": machine.gemm_int8 / 1e9 if machine.gemm_int8 else None,
        "floor_ms": rows["total"]["floor_ms"], "floor_fraction": rows["total"]["floor_fraction"],
        "floor_tok_s": args.batch_size / rows["total"]["floor_ms"] * 1e3,
        "achieved_tok_s": args.batch_size / statistics.median(walls),
        "overhead_split_ms": {k: achieved_ms[k] for k in ("worker_other", "engine")},
        "lm_head_matmul_alone_ms": head_alone_ms,
        "components": rows,
    }
    if profile is not None:
        results["profile_top_ops"] = profile
    return results


def _lm_head_matmul_ms(model: Any, rows: int, hidden: int, repeats: int = 7) -> float:
    """Median ms of the LM head's matmul alone on ``rows`` random hidden states (the step's shape),
    to set against the ``lm_head`` time inside the steps."""
    import torch

    x = torch.randn(rows, hidden)
    head = model.logits_head
    with torch.inference_mode():
        head.matmul(x)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            head.matmul(x)
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _profile_steps(engine: Any, top: int, steps: int = 3) -> list[dict[str, Any]]:
    """The ``top`` ops by self CPU time over ``steps`` more decode steps under torch.profiler
    (printed; its own cost makes these steps slower than the measured ones)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top))
    return [{"op": e.key, "calls_per_step": e.count / steps, "self_ms_per_step": e.self_cpu_time_total / 1e3 / steps}
            for e in events]


def prefix_ttft(args: argparse.Namespace) -> dict[str, Any]:
    from gridserve import SamplingParams

    model = _model_path(args.model)
    llm = _llm(model)
    try:
        rng = random.Random(args.seed)
        vocab = llm.llm_engine.config.model.vocab_size
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

        def tokens(n: int) -> list[int]:
            return [rng.randrange(3, vocab) for _ in range(n)]

        def ttft(prompt: list[int]) -> float:
            start = time.perf_counter()
            llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            return time.perf_counter() - start

        ttft(tokens(args.prefix_len + args.suffix_len))  # warm-up
        cold, warm = [], []
        for _ in range(args.pairs):
            prefix = tokens(args.prefix_len)
            cold.append(ttft(prefix + tokens(args.suffix_len)))  # a fresh prefix: nothing cached
            warm.append(ttft(prefix + tokens(args.suffix_len)))  # the same prefix, another suffix
        stats = llm.llm_engine.core.kv_cache_manager
        hits = getattr(stats, "prefix_cache_hits", None)
    finally:
        llm.shutdown()
    return {
        "model": model, "prefix_len": args.prefix_len, "suffix_len": args.suffix_len, "pairs": args.pairs,
        "cold_median_ms": statistics.median(cold) * 1e3, "warm_median_ms": statistics.median(warm) * 1e3,
        "cold_over_warm": statistics.median(cold) / statistics.median(warm), "prefix_cache_hit_tokens": hits,
    }


def _report(results: dict[str, Any], output: Optional[str]) -> int:
    for key, value in results.items():
        if key in ("components", "profile_top_ops"):
            continue
        print(f"{key:<28}{value:.3f}" if isinstance(value, float) else f"{key:<28}{value}")
    if output:
        Path(output).write_text(json.dumps(results, indent=2))
    return 0


def run_step(args: argparse.Namespace) -> int:
    from gridserve.benchmarks.step_model import format_table

    results = step_overhead(args)
    print(format_table(results["components"]))
    return _report(results, args.output_json)


def run_prefix(args: argparse.Namespace) -> int:
    return _report(prefix_ttft(args), args.output_json)
