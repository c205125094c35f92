"""What batch-invariant mode costs (``gridserve bench batch-invariant``).

Two in-process engines on the same model, one normal and one with ``batch_invariant=True``, each
holding the same ``B`` running requests (prompts of 64-128 tokens); their decode steps alternate
(A/B interleaved, medians), for B = 1, 16 and 64. Then the time to first token of a fresh prompt
of ``--prefill-len`` tokens (prefill; alternated too). Each is timed as wall time and as the
process's CPU time (all threads: less disturbed by other work on a shared machine), medians and the
fastest call. Prints one table; ``--output-json`` keeps it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from pathlib import Path

from gridserve.benchmarks import harness


def _engines(model: str, batch: int):
    from gridserve import LLM

    kwargs = dict(model=model, kv_cache_memory_bytes=64 << 20, max_num_seqs=max(batch, 1), max_model_len=1024)
    return LLM(**kwargs), LLM(batch_invariant=True, **kwargs)


def _fill(llm, batch: int, steps: int, rng: random.Random) -> None:
    from gridserve import SamplingParams

    engine = llm.llm_engine
    vocab = engine.config.model.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=steps + 16, ignore_eos=True)
    for i in range(batch):
        prompt = [rng.randrange(4, vocab) for _ in range(rng.randint(64, 128))]
        engine.add_request({"prompt_token_ids": prompt}, params, str(i))
    scheduler = engine.core.scheduler
    while scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running):
        engine.step()
    for _ in range(2):
        engine.step()  # warm-up decodes


def decode_steps(model: str, batch: int, steps: int, seed: int) -> dict:
    normal, invariant = _engines(model, batch)
    try:
        _fill(normal, batch, steps, random.Random(seed))
        _fill(invariant, batch, steps, random.Random(seed))
        times = _Times()
        for _ in range(steps):
            for name, llm in (("normal", normal), ("invariant", invariant)):
                with times.measure(name):
                    llm.llm_engine.step()
    finally:
        normal.shutdown()
        invariant.shutdown()
    return {"batch": batch, **times.summary()}


class _Times:
    """Wall and CPU seconds per measured call, by engine name."""

    def __init__(self) -> None:
        self.wall: dict[str, list[float]] = {"normal": [], "invariant": []}
        self.cpu: dict[str, list[float]] = {"normal": [], "invariant": []}

    def measure(self, name: str):
        times = self

        class _Measure:
            def __enter__(self):
                self.wall, self.cpu = time.perf_counter(), time.process_time()

            def __exit__(self, *exc):
                times.wall[name].append(time.perf_counter() - self.wall)
                times.cpu[name].append(time.process_time() - self.cpu)

        return _Measure()

    def summary(self) -> dict:
        out = {}
        for kind, values in (("wall", self.wall), ("cpu", self.cpu)):
            a, b = statistics.median(values["normal"]), statistics.median(values["invariant"])
            out.update({f"normal_{kind}_ms": round(a * 1e3, 2), f"invariant_{kind}_ms": round(b * 1e3, 2),
                        f"{kind}_ratio": round(b / a, 2)})
        # the fastest call of each: what a call costs when nothing else ran (a shared machine)
        a, b = min(self.cpu["normal"]), min(self.cpu["invariant"])
        out.update({"normal_min_cpu_ms": round(a * 1e3, 2), "invariant_min_cpu_ms": round(b * 1e3, 2),
                    "min_cpu_ratio": round(b / a, 2)})
        return out


def prefill(model: str, length: int, pairs: int, seed: int) -> dict:
    from gridserve import SamplingParams

    rng = random.Random(seed)
    normal, invariant = _engines(model, 1)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    times, warm_up = _Times(), _Times()
    try:
        for i in range(pairs + 1):
            prompt = {"prompt_token_ids": [rng.randrange(4, 4096) for _ in range(length)]}
            for name, llm in (("normal", normal), ("invariant", invariant)):
                with (times if i else warm_up).measure(name):
                    llm.generate([prompt], params, use_tqdm=False)
    finally:
        normal.shutdown()
        invariant.shutdown()
    return {"prefill_len": length, **times.summary()}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF folder (default: the demo model)")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--steps", type=int, default=15, help="decode steps measured per engine and batch")
    parser.add_argument("--prefill-len", type=int, default=256)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)


def run(args: argparse.Namespace) -> int:
    model = args.model
    if model is None:
        from gridserve.demo.train import ensure_demo_model

        model = str(ensure_demo_model())
    rows = [decode_steps(model, int(b), args.steps, args.seed) for b in args.batches.split(",")]
    first = prefill(model, args.prefill_len, args.pairs, args.seed)
    print(f"{'(ms)':<14}{'normal: median wall / cpu, min cpu':>36}{'invariant: the same':>30}"
          f"{'ratios':>22}")
    for label, r in [(f"decode b={r['batch']}", r) for r in rows] + [(f"prefill {first['prefill_len']}", first)]:
        print(f"{label:<14}{r['normal_wall_ms']:>20} / {r['normal_cpu_ms']} / {r['normal_min_cpu_ms']:<8}"
              f"{r['invariant_wall_ms']:>14} / {r['invariant_cpu_ms']} / {r['invariant_min_cpu_ms']:<8}"
              f"{r['wall_ratio']:>8} / {r['cpu_ratio']} / {r['min_cpu_ratio']}")
    print(f"load average {os.getloadavg()}")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({"decode": rows, "prefill": first, "model": model,
                                                      "load_average": os.getloadavg()}, indent=2) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    return harness.standalone(__doc__, add_arguments, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
