"""Engine-level figures, each from one run against its own baseline.

``gridserve bench step``   decode-step overhead: the wall time of whole engine steps (schedule,
    prepare inputs, forward, sample, update, detokenize) at a batch of B running requests, against
    the time the model's forward and LM head took inside those same steps (same batch, same
    context lengths).
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


def _llm(model: str, **kwargs: Any):
    from gridserve import LLM

    return LLM(model=model, dtype="float32", kv_cache_memory_bytes=2 << 30, **kwargs)


class _ForwardTimer:
    """Wraps the model's ``forward`` and ``compute_logits`` (the LM head: part of a bare forward as
    transformers runs it) and sums the seconds spent in them."""

    METHODS = ("forward", "compute_logits")

    def __init__(self, model: Any) -> None:
        self.seconds = 0.0
        self._model = model
        for name in self.METHODS:
            setattr(model, name, self._timed(getattr(model, name)))

    def _timed(self, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return timed

    def remove(self) -> None:
        for name in self.METHODS:
            delattr(self._model, name)


def step_overhead(args: argparse.Namespace) -> dict[str, Any]:
    from gridserve import SamplingParams

    model = _model_path(args.model)
    llm = _llm(model, max_num_seqs=args.batch_size)
    engine = llm.llm_engine
    try:
        runner = engine.core.executor.worker.runner
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
        timer = _ForwardTimer(runner.model)
        walls, forwards = [], []
        for _ in range(args.steps):
            before = timer.seconds
            start = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - start)
            forwards.append(timer.seconds - before)
        timer.remove()
        running = len(scheduler.running)
    finally:
        llm.shutdown()
    ratios = [w / f for w, f in zip(walls, forwards) if f > 0]
    return {
        "model": model, "batch_size": args.batch_size, "running_during_measure": running, "steps": args.steps,
        "median_step_ms": statistics.median(walls) * 1e3, "median_forward_ms": statistics.median(forwards) * 1e3,
        "step_over_forward_total": sum(walls) / sum(forwards), "step_over_forward_median": statistics.median(ratios),
    }


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
        print(f"{key:<28}{value:.3f}" if isinstance(value, float) else f"{key:<28}{value}")
    if output:
        Path(output).write_text(json.dumps(results, indent=2))
    return 0


def run_step(args: argparse.Namespace) -> int:
    return _report(step_overhead(args), args.output_json)


def run_prefix(args: argparse.Namespace) -> int:
    return _report(prefix_ttft(args), args.output_json)
