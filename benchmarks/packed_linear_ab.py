"""A/B of the packed fp32 linears (``cpu_packed_linear``) inside one engine, step by step.

    python -m gridserve.benchmarks.packed_linear_ab --batch-size 256 --steps 8

Loads the recipe's Llama "base" (fp32) once, keeps both forms of every packed weight (the plain
one for ``F.linear``, the oneDNN one), and swaps them between engine steps: the prefill steps
(chunks of up to ``--max-num-batched-tokens`` prompt tokens) and then ``--steps`` decode steps
alternate plain / packed, so both see the same load and contexts. Prints the median step time and
its components (attention, MLP + projections, LM head, sampler) per variant and the load average.
Benchmark only: serving holds one form, never both.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from typing import Any

import torch


def _forms(model: Any) -> tuple[dict, dict]:
    """``layer -> weight`` for the plain and the packed form of each packed layer."""
    packed = {m: m.weight for m in model.modules() if getattr(m, "cpu_packed", False) and m.weight.is_mkldnn}
    plain = {m: torch.nn.Parameter(w.to_dense()) for m, w in packed.items()}
    return plain, packed


def _use(form: dict) -> None:
    for layer, weight in form.items():
        layer.weight = weight


def run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoConfig

    from gridserve import SamplingParams
    from gridserve.benchmarks import engine as eb
    from gridserve.benchmarks import step_model

    model = eb._model_path(args.model)
    shape = step_model.DecoderShape.from_hf(AutoConfig.from_pretrained(model))
    llm = eb._llm(model, eb._kv_cache_bytes(args, shape), max_num_seqs=args.batch_size,
                  max_num_batched_tokens=args.max_num_batched_tokens)
    engine = llm.llm_engine
    load = [os.getloadavg()[0]]
    try:
        runner = engine.core.executor.worker.runner
        forms = dict(zip(("plain", "packed"), _forms(runner.model)))
        if not forms["packed"]:
            raise SystemExit("no packed layer: is GRIDSERVE_CPU_PACKED_LINEAR=0 set, or oneDNN missing?")
        rng = random.Random(args.seed)
        params = SamplingParams(temperature=0.0, max_tokens=args.steps + 64, ignore_eos=True)
        for i in range(args.batch_size):
            length = rng.randint(args.input_len_min, args.input_len_max)
            engine.add_request({"prompt_token_ids": [rng.randrange(3, shape.vocab) for _ in range(length)]},
                               params, str(i))
        scheduler = engine.core.scheduler
        prefill: dict[str, list[float]] = {name: [] for name in forms}
        i = 0
        while scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running):
            name = ("plain", "packed")[i % 2]
            _use(forms[name])
            start = time.perf_counter()
            engine.step()
            prefill[name].append(time.perf_counter() - start)
            i += 1
        load.append(os.getloadavg()[0])
        for _ in range(2):
            engine.step()  # warm-up decode steps
        timers = eb._step_timers(runner)
        decode: dict[str, list[dict[str, float]]] = {name: [] for name in forms}
        for i in range(2 * args.steps):
            name = ("plain", "packed")[i % 2]
            _use(forms[name])
            before = dict(timers.seconds)
            start = time.perf_counter()
            engine.step()
            wall = time.perf_counter() - start
            decode[name].append(eb._components(wall, {k: v - before[k] for k, v in timers.seconds.items()}))
        timers.remove()
        _use(forms["packed"])
        load.append(os.getloadavg()[0])
    finally:
        llm.shutdown()
    # each variant's first prefill step warms up, the last one is a partial chunk: leave both out
    prefill_ms = {name: statistics.median(t[1:-1]) * 1e3 if len(t) > 2 else float("nan")
                  for name, t in prefill.items()}
    decode_ms = {name: {k: statistics.median(s[k] for s in steps) * 1e3 for k in steps[0]}
                 for name, steps in decode.items()}
    return {"model": model, "batch_size": args.batch_size, "decode_steps_each": args.steps,
            "max_num_batched_tokens": args.max_num_batched_tokens, "load_average": load,
            "prefill_step_ms": prefill_ms, "prefill_steps": {k: max(len(v) - 2, 0) for k, v in prefill.items()},
            "decode_ms": decode_ms,
            "decode_speedup": decode_ms["plain"]["total"] / decode_ms["packed"]["total"],
            "prefill_speedup": prefill_ms["plain"] / prefill_ms["packed"]}


def _print(r: dict[str, Any]) -> None:
    print(f"batch {r['batch_size']}, load average {' / '.join(f'{x:.2f}' for x in r['load_average'])} "
          "(start / after prefill / end)")
    print(f"prefill step (<= {r['max_num_batched_tokens']} tokens), median ms: plain "
          f"{r['prefill_step_ms']['plain']:.1f}, packed {r['prefill_step_ms']['packed']:.1f} "
          f"({r['prefill_speedup']:.2f}x; {r['prefill_steps']['plain']} + {r['prefill_steps']['packed']} steps)")
    print(f"{'decode, median ms':18} {'plain':>9} {'packed':>9} {'x':>6}")
    for k in ("attention", "mlp_proj", "lm_head", "sampler", "overhead", "total"):
        a, b = r["decode_ms"]["plain"][k], r["decode_ms"]["packed"][k]
        print(f"{k:18} {a:9.1f} {b:9.1f} {a / b if b else float('nan'):6.2f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="HF folder (default: the recipe's llama 'base')")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--input-len-min", type=int, default=64)
    parser.add_argument("--input-len-max", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8, help="decode steps per variant")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
    args = parser.parse_args(argv)
    args.kv_cache_memory_bytes, args.kv_cache_dtype = None, "auto"
    results = run(args)
    _print(results)
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
