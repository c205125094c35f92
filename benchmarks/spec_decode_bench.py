"""``gridserve bench spec-decode``: n-gram speculative decoding vs plain decoding, same run.

    gridserve bench spec-decode                       # the default model (SmolLM2 GGUF)
    gridserve bench spec-decode --model PATH --rounds 5 --output-json spec.json

Two offline engines on the same model, one with ``speculative_config`` (n-gram,
``--num-speculative-tokens``), one without. Per round, each engine serves every prompt **one
request at a time** (speculation's case: a decode step bound by reading the weights), alternating
engines prompt by prompt so a busy neighbour slows both alike; then the same prompts **all at
once** (a batch at or above ``disable_by_batch_size``: speculation off, the check that it costs
nothing there). The prompts ask the model to edit code it is given (rename a variable, add a
docstring, add type hints, change a constant): the code-editing shape, whose answers repeat the
prompt's text. Reported: output tokens/s per engine (median over rounds), the ratio, the
acceptance rate and accepted tokens per draft position; greedy outputs are checked equal.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import time

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
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-copies", type=int, default=4,
                        help="the all-at-once part sends every prompt this many times (16 requests by default)")
    parser.add_argument("--output-json", default=None)


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
    common = {"kv_cache_memory_bytes": 512 << 20, "max_model_len": 2048}
    spec_config = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens}
    engines = {"plain": LLM(model=model, **common), "ngram": LLM(model=model, speculative_config=spec_config, **common)}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    chats = _chats()
    single = {name: [] for name in engines}
    batch = {name: [] for name in engines}
    outputs: dict[str, list] = {}
    for name, llm in engines.items():  # warm-up (kernels, first allocations), outputs kept
        outputs[name] = [_timed(llm, [c], params)[1][0] for c in chats]
    if outputs["plain"] != outputs["ngram"]:
        raise RuntimeError("greedy outputs differ with speculation: that is a bug")
    for r in range(args.rounds):
        seconds = {name: 0.0 for name in engines}
        tokens = {name: 0 for name in engines}
        for chat in chats:  # alternating per prompt
            for name, llm in engines.items():
                dt, out = _timed(llm, [chat], params)
                seconds[name] += dt
                tokens[name] += len(out[0])
        for name in engines:
            single[name].append(tokens[name] / seconds[name])
        for name, llm in engines.items():
            dt, outs = _timed(llm, chats * args.batch_copies, params)
            batch[name].append(sum(len(o) for o in outs) / dt)
        logger.info("round %d: one at a time %.1f vs %.1f tok/s, all at once %.1f vs %.1f tok/s (ngram vs plain)",
                    r + 1, single["ngram"][-1], single["plain"][-1], batch["ngram"][-1], batch["plain"][-1])
    stats = engines["ngram"].stats()
    result = {
        "benchmark": "spec-decode", "model": model, "cpus": os.cpu_count(), "load_average": os.getloadavg()[0],
        "num_speculative_tokens": args.num_speculative_tokens, "rounds": args.rounds,
        "one_at_a_time_tok_s": {k: round(statistics.median(v), 1) for k, v in single.items()},
        "all_at_once_tok_s": {k: round(statistics.median(v), 1) for k, v in batch.items()},
        "acceptance_rate": round(stats.spec_num_accepted_tokens / max(stats.spec_num_draft_tokens, 1), 3),
        "accepted_per_position": [round(n / max(stats.spec_num_drafts, 1), 3) for n in stats.spec_accepted_per_pos],
    }
    result["one_at_a_time_ratio"] = round(result["one_at_a_time_tok_s"]["ngram"] / result["one_at_a_time_tok_s"]["plain"], 2)
    result["all_at_once_ratio"] = round(result["all_at_once_tok_s"]["ngram"] / result["all_at_once_tok_s"]["plain"], 2)
    print(json.dumps(result, indent=2))
    print(f"\n| decoding | plain tok/s | n-gram tok/s | ratio |\n|---|---|---|---|\n"
          f"| one request at a time | {result['one_at_a_time_tok_s']['plain']} | "
          f"{result['one_at_a_time_tok_s']['ngram']} | {result['one_at_a_time_ratio']}x |\n"
          f"| {len(chats) * args.batch_copies} at once | {result['all_at_once_tok_s']['plain']} | "
          f"{result['all_at_once_tok_s']['ngram']} | {result['all_at_once_ratio']}x |")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    for llm in engines.values():
        llm.shutdown()
    return 0
