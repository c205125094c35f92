"""``gridserve bench agent-parsing``: what tool calls, reasoning and forced calls cost per output token.

Three parts, each in ms per output token, median over ``--repeats`` (the parts interleaved within
each repeat, A B A B), with the machine's load average before and after:

- **tool parsers** (``services/gateway/tool_parsers``: ``hermes``, ``llama3_json``, ``mistral``,
  ``pythonic``, ``openai``, and ``required``, the forced calls' parser): realistic agent replies in
  each format (the layouts of ``tests/unit/gateway/test_tool_parsers.py``'s fixtures, with longer
  arguments: two parallel weather calls, a ``write_file`` call carrying 40 lines of code, a search
  with nested arguments, and a plain answer with no call), tokenized with a real tokenizer (the
  default model's, SmolLM2's converted GGUF tokenizer, and the demo model's) so every delta is one
  token's text. Timed: the parser alone streamed (``stream(delta)`` per token + ``finish()``), the
  parser's unary ``extract`` of the whole reply, and the gateway's whole per-token work for a
  streamed chat reply (``responses.ChatEvents.chunk``: parse, build the chunk, serialize the SSE
  event) with the parser's plan against the same without one (plain content streaming): the ratio.
- **reasoning parsers** (``services/gateway/reasoning_parsers``: ``deepseek_r1``, ``qwen3``,
  ``openai_gptoss``; and ``qwen3`` + ``hermes`` together, a Qwen3 agent) the same way, on replies
  that think ~120 tokens and then answer.
- **the structured-output constraint** (what ``tool_choice: "required"`` costs in the worker): the
  worker's own ``StructuredOutputManager`` (llguidance) with the ``required`` schema of
  ``services/gateway/tool_choice.py`` for the bench's four tools, walked over the accepted tokens of
  real ``required`` replies (+ EOS): per token, the mask (``apply_bitmask`` on the step's logits:
  llguidance's mask, then the masking) and the advance (``accept_tokens``), per vocabulary (the
  default model's 49152, the demo model's 4096) and per batch of structured rows; and what starting
  a request costs (the first compile, then a matcher copy). Where a measured decode step of that
  vocabulary's model is in ``benchmarks/results`` (``default_model.json``: SmolLM2's served-W
  TPOT, which is its decode step at 256 running; ``zoo_step.json``: the tiny 4096-vocabulary
  Llama's step at batch 64), the cost is also given as a share of that step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
TOOL_PARSER_NAMES = ("hermes", "llama3_json", "mistral", "pythonic", "openai", "required")
REASONING_PARSER_NAMES = ("deepseek_r1", "qwen3", "openai_gptoss", "qwen3+hermes")


def _tool(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


TOOLS = [
    _tool("get_weather", "Current weather in a city", {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["city", "unit"]),
    _tool("get_time", "Local time in a zone", {"zone": {"type": "string"}}, ["zone"]),
    _tool("search", "Search the documentation", {
        "query": {"type": "string"}, "limit": {"type": "integer"},
        "filters": {"type": "object", "properties": {"lang": {"type": "array", "items": {"type": "string"}}}}},
        ["query", "limit", "filters"]),
    _tool("write_file", "Write a file of the workspace", {
        "path": {"type": "string"}, "content": {"type": "string"}}, ["path", "content"]),
]

CODE = "\n".join([
    "import json",
    "from pathlib import Path",
    "",
    "",
    "def load_settings(path: Path) -> dict:",
    '    """The settings file as a dict; an empty dict when it is missing."""',
    "    if not path.exists():",
    "        return {}",
    "    with path.open() as f:",
    "        return json.load(f)",
    "",
    "",
    "def merge(base: dict, override: dict) -> dict:",
    "    merged = dict(base)",
    "    for key, value in override.items():",
    "        if isinstance(value, dict) and isinstance(merged.get(key), dict):",
    "            merged[key] = merge(merged[key], value)",
    "        else:",
    "            merged[key] = value",
    "    return merged",
    "",
    "",
    "def save_settings(path: Path, settings: dict) -> None:",
    "    tmp = path.with_suffix('.tmp')",
    "    tmp.write_text(json.dumps(settings, indent=2, sort_keys=True))",
    "    tmp.replace(path)",
    "",
    "",
    "def main() -> int:",
    "    path = Path.home() / '.config' / 'app' / 'settings.json'",
    "    settings = merge(load_settings(path), {'theme': 'dark', 'editor': {'tab_size': 4}})",
    "    save_settings(path, settings)",
    "    print(f'saved {len(settings)} settings to {path}')",
    "    return 0",
    "",
    "",
    "if __name__ == '__main__':",
    "    raise SystemExit(main())",
    "",
])

# (name, content before the calls, [(function, arguments in schema order)])
REPLIES: list[tuple[str, str, list[tuple[str, dict[str, Any]]]]] = [
    ("parallel calls", "Let me check the weather in both cities.",
     [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_weather", {"city": "Tokyo", "unit": "celsius"})]),
    ("long arguments", "I'll write the fixed settings module.",
     [("write_file", {"path": "src/app/settings.py", "content": CODE})]),
    ("nested arguments", "Searching the docs.",
     [("search", {"query": "how to merge nested dicts in python", "limit": 5, "filters": {"lang": ["en", "fr"]}})]),
    ("no call", "The weather in Paris is mild today: 18 degrees Celsius with a light breeze from the west, and "
                "no rain is expected before the evening. Tokyo is warmer, at 24 degrees, humid and mostly cloudy, "
                "with a chance of showers after six. If you are packing for both, bring a light jacket for Paris "
                "and an umbrella for Tokyo.", []),
]

THOUGHT = ("The user wants the weather in Paris and in Tokyo. I have a get_weather tool that takes a city and a "
           "unit. They did not say which unit, but both cities use Celsius, so I will ask for celsius. The two "
           "lookups do not depend on each other, so I can make both calls at once instead of one after the "
           "other. After the results come back I should compare them and suggest what to pack, keeping the "
           "answer short because the question was short.")
ANSWER = ("Paris is 18 degrees and dry; Tokyo is 24 degrees with showers likely after six. Pack a light jacket "
          "and an umbrella.")


def _render(parser: str, content: str, calls: list[tuple[str, dict[str, Any]]]) -> str:
    """A reply in ``parser``'s format (the layouts of the parser tests' fixtures)."""
    if parser == "required":  # what the forced schema makes the model write (JSON_DEFAULTS' separators)
        return json.dumps([{"name": name, "parameters": args} for name, args in calls])
    if not calls:
        if parser == "openai":
            return (f"<|channel|>analysis<|message|>Answer directly.<|end|><|start|>assistant<|channel|>final"
                    f"<|message|>{content}<|return|>")
        return content
    if parser == "hermes":
        return content + "\n" + "\n".join(
            "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>" for name, args in calls)
    if parser == "llama3_json":
        bodies = [json.dumps({"name": name, "parameters": args}) for name, args in calls]
        return bodies[0] if len(bodies) == 1 else "<|python_tag|>" + "; ".join(bodies)
    if parser == "mistral":
        return content + " [TOOL_CALLS] " + json.dumps([{"name": name, "arguments": args} for name, args in calls])
    if parser == "pythonic":
        return "[" + ", ".join(name + "(" + ", ".join(f"{k}={v!r}" for k, v in args.items()) + ")"
                               for name, args in calls) + "]"
    if parser == "openai":  # one call per harmony reply: the model stops at <|call|>
        name, args = calls[0]
        return (f"<|channel|>analysis<|message|>{content}<|end|><|start|>assistant<|channel|>commentary "
                f"to=functions.{name} <|constrain|>json<|message|>{json.dumps(args)}<|call|>")
    raise ValueError(parser)


def tool_replies(parser: str, tiny: bool) -> list[tuple[str, str, int]]:
    """``(name, text, number of calls it holds)`` per reply of ``parser``'s format."""
    replies = REPLIES[:1] if tiny else REPLIES
    out = []
    for name, content, calls in replies:
        if parser == "required" and not calls:
            continue  # the forced schema has no plain answer
        expected = min(len(calls), 1) if parser == "openai" else len(calls)
        out.append((name, _render(parser, content, calls), expected))
    return out


def reasoning_replies(parser: str, tiny: bool) -> list[tuple[str, str]]:
    thought = THOUGHT[:120] if tiny else THOUGHT
    if parser == "openai_gptoss":
        return [("think then answer", f"<|channel|>analysis<|message|>{thought}<|end|><|start|>assistant"
                                      f"<|channel|>final<|message|>{ANSWER}<|return|>")]
    if parser == "qwen3+hermes":
        calls = REPLIES[0][2]
        return [("think then call", f"<think>\n{thought}\n</think>\n\n" + _render("hermes", "", calls).lstrip())]
    return [("think then answer", f"<think>\n{thought}\n</think>\n\n{ANSWER}")]


# ---- tokenizers ----------------------------------------------------------------------------------
def load_tokenizer(which: str) -> tuple[Any, int, str]:
    """``(HF tokenizer, the model's vocabulary size, what it is)`` for ``default`` or ``demo``."""
    if which == "default":
        from gridserve.default_model import default_model_file
        from gridserve.services.worker.gguf_loader import load_hf_tokenizer

        tok = load_hf_tokenizer(str(default_model_file()))
        return tok, len(tok), "SmolLM2-135M-Instruct (the default model's GGUF tokenizer, converted)"
    if which == "demo":
        from transformers import AutoTokenizer

        from gridserve.demo.recipe import ensure_tokenizer
        from gridserve.demo.train import TrainConfig

        vocab = TrainConfig().vocab_size
        tok = AutoTokenizer.from_pretrained(str(ensure_tokenizer(vocab)))
        return tok, vocab, f"the demo model's byte-level BPE ({vocab} tokens)"
    raise ValueError(f"unknown tokenizer {which!r} (default, demo)")


def token_deltas(tok: Any, text: str) -> tuple[list[int], list[str]]:
    """The token ids of ``text`` and each token's text as the detokenizer streams it."""
    ids = tok.encode(text, add_special_tokens=False)
    deltas, previous = [], ""
    for i in range(len(ids)):
        decoded = tok.decode(ids[: i + 1])
        deltas.append(decoded[len(previous):])
        previous = decoded
    if "".join(deltas) != text:
        raise ValueError(f"the tokenizer does not round-trip {text[:40]!r}")
    return ids, deltas


# ---- timing --------------------------------------------------------------------------------------
def _chunks(deltas: list[str], ids: list[int]) -> list[Any]:
    from gridserve.services.gateway.service import SampleDelta, StreamChunk

    last = len(deltas) - 1
    return [StreamChunk("bench", [SampleDelta(0, d, [t], finish_reason="stop" if i == last else None)], 16)
            for i, (d, t) in enumerate(zip(deltas, ids))]


def _chat_stream(plan: Any, chunks: list[Any]) -> None:
    from gridserve.services.gateway.responses import ChatEvents
    from gridserve.shared.sampling_params import SamplingParams

    events = ChatEvents("bench", "bench", SamplingParams(), 0, include_usage=False, plan=plan)
    events.start()
    for chunk in chunks:
        events.chunk(chunk)
    events.end()


def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _case_fns(kind: str, name: str, replies: list[dict[str, Any]]) -> dict[str, Callable[[], None]]:
    """The timed workloads of one parser over its replies: plain chat stream, with the parser,
    the parser alone streamed, its unary extract."""
    from gridserve.services.gateway.chat_output import ChatPlan
    from gridserve.services.gateway.reasoning_parsers import REASONING_PARSERS, PromptState
    from gridserve.services.gateway.tool_choice import ToolPlan
    from gridserve.services.gateway.tool_parsers import TOOL_PARSERS
    from gridserve.services.gateway.tool_parsers.forced import RequiredToolParser

    if kind == "tool":
        plan = ChatPlan(ToolPlan("required", TOOLS, TOOLS) if name == "required" else
                        ToolPlan("auto", TOOLS, TOOLS, parser_name=name))
        parser_cls: Any = RequiredToolParser if name == "required" else TOOL_PARSERS[name]

        def make() -> Any:
            return parser_cls(TOOLS)
    elif name == "qwen3+hermes":
        plan = ChatPlan(ToolPlan("auto", TOOLS, TOOLS, parser_name="hermes"), "qwen3")
        make = plan.choice  # a ChoiceParser: feed / finish / parse
    else:
        plan = ChatPlan(ToolPlan("none"), name, PromptState.NONE)

        def make() -> Any:
            return REASONING_PARSERS[name](PromptState.NONE)

    def plain() -> None:
        for r in replies:
            _chat_stream(None, r["chunks"])

    def with_parser() -> None:
        for r in replies:
            _chat_stream(plan, r["chunks"])

    def stream() -> None:
        for r in replies:
            parser = make()
            feed = parser.feed if hasattr(parser, "feed") else parser.stream
            for delta in r["deltas"]:
                feed(delta)
            parser.finish()

    def extract() -> None:
        for r in replies:
            parser = make()
            (parser.parse if hasattr(parser, "parse") else parser.extract)(r["text"])

    return {"plain_chat_stream": plain, "chat_stream_with_parser": with_parser, "parser_stream": stream,
            "parser_extract": extract}


def _check(kind: str, name: str, replies: list[dict[str, Any]]) -> None:
    """The replies parse as intended (the bench times real parsing, not fall-backs to content)."""
    from gridserve.services.gateway.chat_output import ChatPlan
    from gridserve.services.gateway.reasoning_parsers import PromptState
    from gridserve.services.gateway.tool_choice import ToolPlan

    for r in replies:
        if kind == "tool":
            tools = (ToolPlan("required", TOOLS, TOOLS) if name == "required" else
                     ToolPlan("auto", TOOLS, TOOLS, parser_name=name))
            parts = ChatPlan(tools).choice().parse(r["text"])
            if len(parts.tool_calls) != r["calls"]:
                raise AssertionError(f"{name} found {len(parts.tool_calls)} calls in {r['name']!r}, not {r['calls']}")
        else:
            tools = ToolPlan("auto", TOOLS, TOOLS, parser_name="hermes") if name == "qwen3+hermes" else ToolPlan("none")
            parts = ChatPlan(tools, name.split("+")[0], PromptState.NONE).choice().parse(r["text"])
            if not parts.reasoning:
                raise AssertionError(f"{name} found no reasoning in {r['name']!r}")


def bench_parsers(tok: Any, repeats: int, inner: int, tiny: bool) -> dict[str, Any]:
    cases = [("tool", n, tool_replies(n, tiny)) for n in TOOL_PARSER_NAMES]
    cases += [("reasoning", n, [(name, text, 0) for name, text in reasoning_replies(n, tiny)])
              for n in REASONING_PARSER_NAMES]
    prepared = []
    for kind, name, replies in cases:
        rows = []
        for reply_name, text, calls in replies:
            ids, deltas = token_deltas(tok, text)
            rows.append({"name": reply_name, "text": text, "calls": calls, "ids": ids, "deltas": deltas,
                         "chunks": _chunks(deltas, ids)})
        _check(kind, name, rows)
        prepared.append((kind, name, rows, _case_fns(kind, name, rows)))
    for _, _, _, fns in prepared:  # warm-up: first calls (pydantic's serializers, caches) are not timed
        for fn in fns.values():
            fn()
    samples: dict[tuple[str, str], list[float]] = {}
    for _ in range(repeats):
        for _kind, name, rows, fns in prepared:
            tokens = sum(len(r["ids"]) for r in rows) * inner
            for what, fn in fns.items():  # interleaved: plain, with parser, alone, extract, per repeat
                elapsed = sum(_timed(fn) for _ in range(inner))
                samples.setdefault((name, what), []).append(elapsed * 1e3 / tokens)
    out: dict[str, Any] = {"tool_parsers": {}, "reasoning_parsers": {}}
    for kind, name, rows, fns in prepared:
        med = {what: statistics.median(samples[(name, what)]) for what in fns}
        out[f"{kind}_parsers"][name] = {
            "replies": [{"name": r["name"], "tokens": len(r["ids"]), "calls": r["calls"]} for r in rows],
            "tokens": sum(len(r["ids"]) for r in rows),
            **{f"{what}_ms_per_token": ms for what, ms in med.items()},
            "ratio_chat_stream_with_parser_vs_plain": med["chat_stream_with_parser"] / med["plain_chat_stream"],
            "parser_stream_vs_plain_chat_stream": med["parser_stream"] / med["plain_chat_stream"],
        }
    return out


# ---- structured output ---------------------------------------------------------------------------
def _step_references() -> dict[int, dict[str, Any]]:
    """Measured decode steps in benchmarks/results by vocabulary size."""
    refs: dict[int, dict[str, Any]] = {}
    try:
        fp32 = json.loads((RESULTS / "default_model.json").read_text())["served_w"]["fp32"]
        refs[49152] = {"step_ms": fp32["median_tpot_ms"], "source": "benchmarks/results/default_model.json "
                       "served_w.fp32.median_tpot_ms (SmolLM2-135M, W: 256 running, CPU)"}
    except (OSError, KeyError, ValueError):
        pass
    try:
        zoo = json.loads((RESULTS / "zoo_step.json").read_text())
        llama = next(r for r in zoo["rows"] if r["architecture"] == "LlamaForCausalLM")
        refs[zoo["shape"]["vocab"]] = {"step_ms": llama["step_ms"], "source": "benchmarks/results/zoo_step.json "
                                       f"LlamaForCausalLM step_ms (tiny Llama, batch {zoo['batch_size']}, CPU)"}
    except (OSError, KeyError, ValueError, StopIteration):
        pass
    return refs


def bench_structured(tok: Any, vocab: int, repeats: int, batch_sizes: list[int], tiny: bool) -> dict[str, Any]:
    import torch

    from gridserve.services.gateway.tool_choice import required_schema
    from gridserve.services.worker.structured_output import StructuredOutputManager
    from gridserve.shared.sampling_params import StructuredOutputsParams

    params = StructuredOutputsParams(json=required_schema(TOOLS, parallel=True))
    texts = [text for _, text, _ in tool_replies("required", tiny)]
    sequences = [tok.encode(t, add_special_tokens=False) for t in texts]
    manager = StructuredOutputManager(tok, vocab, eos_token_id=tok.eos_token_id)
    eos = manager.eos_token_id
    sequences = [s + [eos] for s in sequences]
    start = time.perf_counter()
    manager.add_request("cold", params)  # compiles the schema's grammar for this tokenizer
    cold_ms = (time.perf_counter() - start) * 1e3
    manager.remove("cold")
    copies = []
    for i in range(max(3, repeats)):
        start = time.perf_counter()
        manager.add_request(f"warm{i}", params)
        copies.append((time.perf_counter() - start) * 1e3)
        manager.remove(f"warm{i}")

    per_batch = {}
    for batch in batch_sizes:
        logits = torch.zeros((batch, manager.vocab_size), dtype=torch.float32)
        mask_samples, accept_samples, fill_samples = [], [], []
        for r in range(repeats):
            mask_s = accept_s = fill_s = 0.0
            steps = 0
            for s, seq in enumerate(sequences):
                req_ids = [f"r{r}-{s}-{b}" for b in range(batch)]
                for req_id in req_ids:
                    manager.add_request(req_id, params)
                matchers = [manager._matchers[q] for q in req_ids]
                for token in seq:
                    t0 = time.perf_counter()
                    manager._fill(matchers)  # llguidance's mask alone
                    t1 = time.perf_counter()
                    manager.apply_bitmask(logits, req_ids)  # the worker's step: mask + masking the logits
                    t2 = time.perf_counter()
                    failures = manager.accept_tokens(req_ids, [token] * batch)
                    t3 = time.perf_counter()
                    if failures:
                        raise AssertionError(f"the required schema refused a token of its own reply: {failures}")
                    fill_s += t1 - t0
                    mask_s += t2 - t1
                    accept_s += t3 - t2
                    steps += 1
                if not all(m.is_stopped() or m.is_accepting() for m in matchers):
                    raise AssertionError("the required reply did not complete its grammar")
                for req_id in req_ids:
                    manager.remove(req_id)
            rows_tokens = steps * batch  # output tokens produced, one per structured row per step
            fill_samples.append(fill_s * 1e3 / rows_tokens)
            mask_samples.append(mask_s * 1e3 / rows_tokens)
            accept_samples.append(accept_s * 1e3 / rows_tokens)
        mask, accept = statistics.median(mask_samples), statistics.median(accept_samples)
        per_batch[str(batch)] = {
            "structured_rows": batch,
            "llguidance_mask_ms_per_token": statistics.median(fill_samples),
            "apply_bitmask_ms_per_token": mask,
            "accept_tokens_ms_per_token": accept,
            "total_ms_per_token": mask + accept,
            "total_ms_per_step": (mask + accept) * batch,
        }
    out: dict[str, Any] = {
        "vocab_size": manager.vocab_size,
        "schema": "tool_choice required, parallel_tool_calls (services/gateway/tool_choice.py required_schema), "
                  f"{len(TOOLS)} tools",
        "accepted_tokens": [len(s) for s in sequences],
        "first_add_request_ms (compile)": cold_ms,
        "add_request_ms (matcher copy)": statistics.median(copies),
        "per_batch": per_batch,
    }
    ref = _step_references().get(manager.vocab_size)
    if ref is not None:
        out["decode_step_reference"] = ref
        for row in per_batch.values():
            row["share_of_decode_step"] = row["total_ms_per_step"] / ref["step_ms"]
    return out


# ---- the command ---------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokenizers", default="default,demo",
                        help="comma-separated: default (SmolLM2's GGUF tokenizer, 49152), demo (4096)")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--inner", type=int, default=3, help="passes over the replies per parser sample")
    parser.add_argument("--batch-sizes", default="1,8", help="structured rows per step for the constraint")
    parser.add_argument("--tiny", action="store_true",
                        help="one reply per format, a short thought, 2 repeats, batch 1 (a smoke test)")
    parser.add_argument("--output-json", default=str(RESULTS / "agent_parsing.json"))


def run(args: argparse.Namespace) -> int:
    repeats, inner = (2, 1) if args.tiny else (args.repeats, args.inner)
    batch_sizes = [1] if args.tiny else [int(b) for b in args.batch_sizes.split(",")]
    load_before = os.getloadavg()
    started = time.perf_counter()
    report: dict[str, Any] = {
        "benchmark": "agent-parsing", "unit": "ms per output token", "statistic": f"median of {repeats} repeats",
        "repeats": repeats, "inner": inner, "tiny": bool(args.tiny), "cpus": os.cpu_count(),
        "load_average_before": list(load_before), "tokenizers": {},
    }
    for which in [w.strip() for w in args.tokenizers.split(",") if w.strip()]:
        tok, vocab, what = load_tokenizer(which)
        print(f"[{which}] {what}: parsers ...", flush=True)
        entry: dict[str, Any] = {"tokenizer": what, "vocab_size": vocab}
        entry.update(bench_parsers(tok, repeats, inner, args.tiny))
        print(f"[{which}] structured output ...", flush=True)
        entry["structured_output"] = bench_structured(tok, vocab, repeats, batch_sizes, args.tiny)
        report["tokenizers"][which] = entry
        _print(which, entry)
    report["load_average_after"] = list(os.getloadavg())
    report["wall_s"] = time.perf_counter() - started
    out = Path(args.output_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"load average {load_before} -> {os.getloadavg()}; wrote {out}")
    return 0


def _print(which: str, entry: dict[str, Any]) -> None:
    print(f"{'parser':<14} {'tokens':>6} {'plain':>8} {'w/parser':>9} {'ratio':>6} {'alone':>8} {'extract':>8}  "
          f"(ms/token, {which})")
    for kind in ("tool_parsers", "reasoning_parsers"):
        for name, r in entry[kind].items():
            print(f"{name:<14} {r['tokens']:>6} {r['plain_chat_stream_ms_per_token']:>8.4f} "
                  f"{r['chat_stream_with_parser_ms_per_token']:>9.4f} {r['ratio_chat_stream_with_parser_vs_plain']:>6.2f} "
                  f"{r['parser_stream_ms_per_token']:>8.4f} {r['parser_extract_ms_per_token']:>8.4f}")
    so = entry["structured_output"]
    for batch, r in so["per_batch"].items():
        share = f", {r['share_of_decode_step']:.2%} of a decode step" if "share_of_decode_step" in r else ""
        print(f"structured output, vocab {so['vocab_size']}, {batch} row(s): mask {r['apply_bitmask_ms_per_token']:.4f} "
              f"+ accept {r['accept_tokens_ms_per_token']:.4f} = {r['total_ms_per_token']:.4f} ms/token{share}")
