"""``gridserve bench spec-decode``: speculative decoding (n-gram or a draft model) vs plain decoding,
same run.

    gridserve bench spec-decode                       # n-gram, the default model (SmolLM2 GGUF)
    gridserve bench spec-decode --model PATH --rounds 5 --output-json spec.json
    gridserve bench spec-decode --method draft        # a draft model: the target's first layer
    gridserve bench spec-decode --method draft --draft-model PATH --temperature 0.7

Two offline engines on the same model, one with ``speculative_config`` (``--method``:
``ngram``, or ``draft`` with ``--draft-model``, by default the target cut to its first
``--draft-layers`` layers with its own embeddings and LM head — the SmolLM2 default cut to one
layer holds about a quarter of its bytes, a "4x smaller" draft when no real pair is at hand),
one without. Per round, each engine serves every prompt **one
request at a time** (speculation's case: a decode step bound by reading the weights), alternating
engines prompt by prompt so a busy neighbour slows both alike; then the same prompts **all at
once** (a batch at or above ``disable_by_batch_size``: speculation off, the check that it costs
nothing there). The prompts ask the model to edit code it is given (rename a variable, add a
docstring, add type hints, change a constant): the code-editing shape, whose answers repeat the
prompt's text. Reported: output tokens/s per engine (median over rounds), the ratio, the
acceptance rate and accepted tokens per draft position; greedy outputs are checked equal
(``--temperature`` > 0 samples, seeded: a draft model's drafts are then drawn from its
distribution and verified by rejection sampling, and outputs are not compared).

With a draft model also **the step-time model**: one request's decode step of the plain engine
(``T``), the spec engine's step (the target verifying ``1 + k`` tokens, then the draft proposing)
and the draft's one-token pass (``T_d``), each the median of the steps timed in the worker, and
the mean accepted length ``a`` (accepted drafts per verify step). A spec step emits ``1 + a``
tokens, so the predicted speed-up is ``(1 + a) T / T_spec_step``; Leviathan et al.'s form with a
verify step costing ``T`` is ``(1 + a) / (1 + k T_d / T)``. Both beside the measured ratio.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import statistics
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

CODE = '''def total_price(items, tax_rate, discount=0.0):
    """Price of a basket."""
    subtotal = 0.0
    for item in items:
        subtotal += item.price * item.quantity
    subtotal -= subtotal * discount
    tax = subtotal * tax_rate
    return round(subtotal + tax, 2)


def cheapest(items):
    best = None
    for item in items:
        if best is None or item.price < best.price:
            best = item
    return best
'''
ASKS = (
    "Rename the variable `subtotal` to `net` everywhere in this code.",
    "Rename the function `cheapest` to `lowest_priced` in this code.",
    "Change `round(subtotal + tax, 2)` to `round(subtotal + tax, 3)` in this code.",
    "Rename the parameter `items` to `products` in this code.",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint or .gguf (default: the default model)")
    parser.add_argument("--method", choices=("ngram", "draft"), default="ngram")
    parser.add_argument("--draft-model", default=None,
                        help="the draft checkpoint (--method draft; default: the target cut to --draft-layers)")
    parser.add_argument("--draft-layers", type=int, default=1,
                        help="layers of the target kept in the default draft (embeddings and LM head kept)")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=0.0, help="> 0: seeded sampling, outputs not compared")
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-copies", type=int, default=4,
                        help="the all-at-once part sends every prompt this many times (16 requests by default)")
    parser.add_argument("--output-json", default=None)


def truncated_draft(model: str, layers: int) -> str:
    """A draft checkpoint made of the target's first ``layers`` decoder layers, its embeddings,
    final norm and LM head (a GGUF target's tensors dequantized), cached by the target's path, size
    and time. The draft shares the target's tokenizer by construction."""
    from safetensors.torch import save_file

    from gridserve.demo.recipe import default_cache_dir
    from gridserve.services.worker.checkpoint import iterate_weights
    from gridserve.services.worker.gguf_loader import iterate_gguf_weights
    from gridserve.shared.config import ModelConfig
    from gridserve.shared.gguf_config import is_gguf

    target = ModelConfig(model=model).resolve()
    if not 1 <= layers < target.num_layers:
        raise ValueError(f"--draft-layers must be in 1..{target.num_layers - 1}, got {layers}")
    stat = Path(target.model_path).stat()
    key = hashlib.sha256(f"{Path(target.model_path).resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    folder = default_cache_dir() / "spec-drafts" / f"{Path(target.model_path).stem}-{layers}L-{key[:12]}"
    if (folder / "model.safetensors").is_file():
        return str(folder)
    folder.mkdir(parents=True, exist_ok=True)
    weights = (iterate_gguf_weights(target.model_path, target.hf_config) if is_gguf(target.model_path)
               else iterate_weights(target.model_path))
    kept = {}
    for name, tensor in weights:
        parts = name.split(".")
        layer = int(parts[parts.index("layers") + 1]) if "layers" in parts else -1
        if layer < layers:
            kept[name] = tensor.full().float().contiguous()
    config = {**target.hf_config, "architectures": [target.architecture], "num_hidden_layers": layers,
              "torch_dtype": "float32"}
    config.pop("dtype", None)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file(kept, str(folder / "model.safetensors.partial"))
    os.replace(folder / "model.safetensors.partial", folder / "model.safetensors")
    logger.info("draft: %s (%d of %d layers, %.1f MiB)", folder, layers, target.num_layers,
                sum(t.numel() * 4 for t in kept.values()) / 2**20)
    return str(folder)


class StepTimer:
    """Times an engine's worker steps (``execute_model``) and, with a draft model, its draft passes
    (``DraftModelProposer._step``): wraps the in-process runner's methods."""

    def __init__(self, llm: Any) -> None:
        runner = llm.llm_engine.core.executor.worker.runner
        self.decode_steps: list[float] = []  # one request: 1 token, or 1 + its drafts
        self.draft_passes: list[float] = []  # one request, one token
        self._draft_in_step = 0.0
        execute, self.runner = runner.execute_model, runner

        def timed_execute(sched):
            self._draft_in_step = 0.0
            start = time.perf_counter()
            out = execute(sched)
            seconds = time.perf_counter() - start
            if len(sched.num_scheduled_tokens) == 1 and not sched.scheduled_new_reqs:
                (req_id, n), = sched.num_scheduled_tokens.items()
                if n == 1 + len(sched.scheduled_spec_tokens.get(req_id, ())):
                    self.decode_steps.append(seconds)
            return out

        runner.execute_model = timed_execute
        if runner.drafter is not None:
            step = runner.drafter._step

            def timed_step(tables, starts, tokens):
                start = time.perf_counter()
                out = step(tables, starts, tokens)
                seconds = time.perf_counter() - start
                self._draft_in_step += seconds
                if len(tokens) == 1 and len(tokens[0]) == 1:
                    self.draft_passes.append(seconds)
                return out

            runner.drafter._step = timed_step

    def clear(self) -> None:
        self.decode_steps.clear()
        self.draft_passes.clear()


def _ms(values: list[float]) -> float:
    return round(statistics.median(values) * 1e3, 3) if values else float("nan")


def step_model(plain: StepTimer, spec: StepTimer, k: int, mean_accepted: float) -> dict:
    """The predicted speed-up from the measured step times and the acceptance."""
    t, t_spec, t_draft = _ms(plain.decode_steps), _ms(spec.decode_steps), _ms(spec.draft_passes)
    return {
        "target_step_ms": t, "spec_step_ms": t_spec, "draft_pass_ms": t_draft,
        "draft_to_target_cost": round(t_draft / t, 3),
        "predicted_speedup": round((1 + mean_accepted) * t / t_spec, 2),
        "predicted_speedup_leviathan": round((1 + mean_accepted) / (1 + k * t_draft / t), 2),
    }


def _chats() -> list[list[dict]]:
    return [[{"role": "user", "content": f"{ask} Answer with the whole code only.\n\n```python\n{CODE}```"}]
            for ask in ASKS]


def _timed(llm, chats, params) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    outs = llm.chat(chats, params, use_tqdm=False) if len(chats) > 1 else [llm.chat(chats[0], params, use_tqdm=False)[0]]
    return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outs]


def run(args: argparse.Namespace) -> int:
    from gridserve import LLM, SamplingParams
    from gridserve.default_model import default_model_file

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    model = args.model or str(default_model_file())
    k = args.num_speculative_tokens
    common = {"kv_cache_memory_bytes": 512 << 20, "max_model_len": 2048}
    if args.method == "ngram":
        name, spec_config = "ngram", {"method": "ngram", "num_speculative_tokens": k}
    else:
        draft = args.draft_model or truncated_draft(model, args.draft_layers)
        name, spec_config = "draft", {"model": draft, "num_speculative_tokens": k}
    engines = {"plain": LLM(model=model, **common), name: LLM(model=model, speculative_config=spec_config, **common)}
    timers = {key: StepTimer(llm) for key, llm in engines.items()} if args.method == "draft" else {}
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                            seed=1234 if args.temperature > 0 else None)
    chats = _chats()
    single = {key: [] for key in engines}
    batch = {key: [] for key in engines}
    outputs: dict[str, list] = {}
    for key, llm in engines.items():  # warm-up (kernels, first allocations), outputs kept
        outputs[key] = [_timed(llm, [c], params)[1][0] for c in chats]
    if args.temperature == 0 and outputs["plain"] != outputs[name]:
        raise RuntimeError("greedy outputs differ with speculation: that is a bug")
    for timer in timers.values():
        timer.clear()
    for r in range(args.rounds):
        seconds = {key: 0.0 for key in engines}
        tokens = {key: 0 for key in engines}
        for chat in chats:  # alternating per prompt
            for key, llm in engines.items():
                dt, out = _timed(llm, [chat], params)
                seconds[key] += dt
                tokens[key] += len(out[0])
        for key in engines:
            single[key].append(tokens[key] / seconds[key])
        for key, llm in engines.items():
            dt, outs = _timed(llm, chats * args.batch_copies, params)
            batch[key].append(sum(len(o) for o in outs) / dt)
        logger.info("round %d: one at a time %.1f vs %.1f tok/s, all at once %.1f vs %.1f tok/s (%s vs plain)",
                    r + 1, single[name][-1], single["plain"][-1], batch[name][-1], batch["plain"][-1], name)
    stats = engines[name].stats()
    drafts = max(stats.spec_num_drafts, 1)
    mean_accepted = stats.spec_num_accepted_tokens / drafts
    result = {
        "benchmark": "spec-decode", "method": name, "model": model, "cpus": os.cpu_count(),
        "load_average": os.getloadavg()[0], "num_speculative_tokens": k, "rounds": args.rounds,
        "temperature": args.temperature,
        "one_at_a_time_tok_s": {key: round(statistics.median(v), 1) for key, v in single.items()},
        "all_at_once_tok_s": {key: round(statistics.median(v), 1) for key, v in batch.items()},
        "acceptance_rate": round(stats.spec_num_accepted_tokens / max(stats.spec_num_draft_tokens, 1), 3),
        "accepted_per_position": [round(n / drafts, 3) for n in stats.spec_accepted_per_pos],
        "mean_accepted_length": round(mean_accepted, 3),
    }
    if name == "draft":
        result["draft_model"] = spec_config["model"]
        result["step_model"] = step_model(timers["plain"], timers["draft"], k, mean_accepted)
    result["one_at_a_time_ratio"] = round(result["one_at_a_time_tok_s"][name] / result["one_at_a_time_tok_s"]["plain"], 2)
    result["all_at_once_ratio"] = round(result["all_at_once_tok_s"][name] / result["all_at_once_tok_s"]["plain"], 2)
    print(json.dumps(result, indent=2))
    label = "n-gram" if name == "ngram" else "draft model"
    print(f"\n| decoding | plain tok/s | {label} tok/s | ratio |\n|---|---|---|---|\n"
          f"| one request at a time | {result['one_at_a_time_tok_s']['plain']} | "
          f"{result['one_at_a_time_tok_s'][name]} | {result['one_at_a_time_ratio']}x |\n"
          f"| {len(chats) * args.batch_copies} at once | {result['all_at_once_tok_s']['plain']} | "
          f"{result['all_at_once_tok_s'][name]} | {result['all_at_once_ratio']}x |")
    if name == "draft":
        m = result["step_model"]
        print(f"\nacceptance per position {result['accepted_per_position']}, mean accepted length "
              f"{result['mean_accepted_length']}; steps: target {m['target_step_ms']} ms, spec "
              f"{m['spec_step_ms']} ms, draft pass {m['draft_pass_ms']} ms; predicted "
              f"{m['predicted_speedup']}x (Leviathan's form {m['predicted_speedup_leviathan']}x), measured "
              f"{result['one_at_a_time_ratio']}x")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    for llm in engines.values():
        llm.shutdown()
    return 0
