"""``gridserve bench sampler``: per-step sampler cost at batch 64, plain vs a mixed batch.

Both batches run through the worker's real code (``ModelRunner._sampling_metadata``, ``Sampler``,
``StructuredOutputManager``) on random logits of the model's vocabulary size, interleaved
``--repeats`` times; the report is the median time of each and their ratio. Every row is seeded;
the same plain batch with no seed (torch's generator) runs in the same loop, so the cost of
seeding every row (the deterministic, resumable draw) is measured against today's unseeded batch.

It also times, in the same loop, the draw the sampler used before counter-based sampling — an
unseeded exponential race over the whole vocabulary (``argmax(p / q)``, ``q ~ Exp(1)`` from torch's
generator) — against today's seeded inverse-CDF draw on the same probabilities: the baseline the
deterministic sampler must not be slower than.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from gridserve.shared.sampling_params import SamplingParams, StructuredOutputsParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                            "tags": {"type": "array", "items": {"enum": ["a", "b"]}}}}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF folder (default: the recipe's llama base)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--output-json", default="benchmarks/results/sampler.json")


def _batches(batch: int) -> tuple[list[SamplingParams], list[SamplingParams], list[SamplingParams]]:
    plain = [SamplingParams(temperature=1.0, seed=i, max_tokens=64) for i in range(batch)]
    unseeded = [SamplingParams(temperature=1.0, max_tokens=64) for _ in range(batch)]
    mixed = []
    for i in range(batch):
        kwargs = {"temperature": 1.0, "seed": i, "max_tokens": 64}
        if i % 2 == 0:
            kwargs["top_p"] = 0.9
        if i % 4 == 1:
            kwargs.update(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.3)
        if i < 8:
            kwargs["structured_outputs"] = StructuredOutputsParams(json=SCHEMA)
        mixed.append(SamplingParams(**kwargs))
    return plain, mixed, unseeded


def _draw_times(plain, logits, vocab: int, repeats: int) -> tuple[float, float]:
    """Median ms of the previous unseeded draw and of today's seeded draw, interleaved."""
    import torch

    from gridserve.services.worker.sampler import inverse_cdf_sample

    runner, req_ids = plain
    probs = logits.softmax(dim=-1)
    race, counter = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        probs.div(torch.empty_like(probs).exponential_()).argmax(dim=-1)
        race.append(time.perf_counter() - start)
        start = time.perf_counter()
        inverse_cdf_sample(probs, runner._uniforms([runner.requests[r] for r in req_ids]))
        counter.append(time.perf_counter() - start)
    return statistics.median(race) * 1e3, statistics.median(counter) * 1e3


def run(args: argparse.Namespace) -> int:
    import torch

    from gridserve.demo.recipe import ensure_checkpoint
    from gridserve.services.worker.model_runner import ModelRunner
    from gridserve.shared.config import GridserveConfig
    from gridserve.shared.scheduler_output import NewRequestData, SchedulerOutput

    model = args.model or str(ensure_checkpoint("llama", "base"))
    config = GridserveConfig.from_kwargs(model=model).finalize()
    vocab = config.model.vocab_size
    runners = {}
    for name, params in zip(("plain", "mixed", "unseeded"), _batches(args.batch_size)):
        runner = ModelRunner(config, torch.device("cpu"))
        new = [NewRequestData(f"{name}{i}", list(range(10, 60)), p, [1, 2, 3, 4], 0) for i, p in enumerate(params)]
        runner._update_states(SchedulerOutput(scheduled_new_reqs=new))
        for state in runner.requests.values():  # some output history for the penalties
            state.token_ids += list(range(200, 232))
        runners[name] = (runner, [r.req_id for r in new])
    times: dict[str, list[float]] = {name: [] for name in runners}
    logits = torch.randn(args.batch_size, vocab)
    for _ in range(args.repeats):
        for name, (runner, req_ids) in runners.items():
            step_logits = logits.clone()
            start = time.perf_counter()
            if runner.structured_output is not None:
                runner.structured_output.apply_bitmask(step_logits, req_ids)
            meta = runner._sampling_metadata(req_ids, vocab)
            sampled, _ = runner.sampler(step_logits, meta)
            if runner.structured_output is not None:
                runner.structured_output.accept_tokens(req_ids, sampled.tolist())
            times[name].append(time.perf_counter() - start)
    plain, mixed, unseeded = (statistics.median(times[k]) * 1e3 for k in ("plain", "mixed", "unseeded"))
    race, counter = _draw_times(runners["plain"], logits, vocab, args.repeats)
    result = {"batch_size": args.batch_size, "vocab_size": vocab, "repeats": args.repeats,
              "plain_ms": plain, "mixed_ms": mixed, "ratio": mixed / plain,
              "unseeded_ms": unseeded, "seeded_vs_unseeded": plain / unseeded,
              "unseeded_exponential_race_ms": race, "seeded_counter_inverse_cdf_ms": counter,
              "seeded_vs_unseeded_before": counter / race}
    print(f"sampler step, batch {args.batch_size}, vocab {vocab}: plain {plain:.2f} ms, "
          f"mixed (penalties + top-p + 8 JSON-schema) {mixed:.2f} ms, ratio {mixed / plain:.2f}x")
    print(f"every row seeded {plain:.2f} ms vs the same batch unseeded {unseeded:.2f} ms: "
          f"{plain / unseeded:.2f}x")
    print(f"the draw alone: unseeded exponential race (before) {race:.2f} ms, every row seeded, "
          f"counter-based inverse CDF (now) {counter:.2f} ms, ratio {counter / race:.2f}x")
    Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output_json).write_text(json.dumps(result, indent=2))
    return 0
