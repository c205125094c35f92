"""``gridserve bench lora``: served W on 4 LoRA adapters vs served W on the base model (issue 35).

    gridserve bench lora                                  # the default model, W, 3 runs per config
    gridserve bench lora --num-requests 32 --runs 1       # a quick check that it works
    gridserve bench lora --model HF_FOLDER --with-base-on-lora-server --output-json lora.json

**Model**: by default the default model (SmolLM2-135M-Instruct, the Q4_1 GGUF from the package, as
``bench default-model`` and ``served-ab`` serve it); ``--model`` takes another checkpoint folder or
``.gguf``. The adapters are made here, in a temp folder (``--adapter-dir`` keeps them), as PEFT
saves them: ``--num-adapters`` (4) random adapters (``LoraConfig(init_lora_weights=False)``: PEFT's
default B = 0 would make them no-ops the server might skip), rank ``--rank`` (16), ``lora_alpha`` 2 x
rank, on q/k/v/o/gate/up/down (vLLM's usual targets), seeds 1..N. PEFT needs the base as a
transformers model: for a GGUF it is the model transformers builds from that GGUF
(``AutoModelForCausalLM.from_pretrained(folder, gguf_file=...)``, dequantized), whose module names
and shapes are the Llama ones gridserve's loader maps.

**Runs**, alternating A B (A B ...) so that a busy neighbour or slow drift in the machine's load
falls on both: **A** ``gridserve serve`` without ``--enable-lora``, served W on the base model;
**B** ``gridserve serve --enable-lora --max-loras N --max-lora-rank R --lora-modules ...``, served W
with request i naming adapter i % N as its ``model`` (every request on an adapter, all N in every
step). With ``--with-base-on-lora-server``, **C**: on server B, right after B's run, W on the base
model (what ``--enable-lora`` alone costs). Each server is started, awaited (its ``gridserve ready``
line), measured and stopped (SIGTERM, then SIGKILL of its process group) before the next; its log is
kept (``--log-dir``).

Served W (docs/benchmarks: 256 requests at once, prompts 64-256 tokens, outputs 32-256,
``ignore_eos``, greedy) with ``bench default-model``'s client; ``--num-requests`` scales it down.
Per run: output tok/s, median TTFT and TPOT, the load average. Summary: per config medians, the
B / A ratio of medians and the median of the paired ratios (run i of B over run i of A), and the
same for C. Issue 35's bar: B / A >= 0.8.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

from gridserve.benchmarks.served_ab import logged_server

logger = logging.getLogger(__name__)

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIGS = ("base", "lora", "base_on_lora_server")  # A, B, C
BAR = 0.8  # issue 35: served W on adapters >= 0.8x served W on the base model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="base model: checkpoint folder or .gguf (default: the "
                        "default model, SmolLM2-135M-Instruct GGUF)")
    parser.add_argument("--runs", type=int, default=3, help="runs per config, alternating base / lora")
    parser.add_argument("--num-adapters", type=int, default=4, help="adapters; request i names adapter i %% N")
    parser.add_argument("--rank", type=int, default=16, help="every adapter's rank (also --max-lora-rank)")
    parser.add_argument("--targets", default=",".join(TARGETS), help="the adapters' target modules")
    parser.add_argument("--with-base-on-lora-server", action="store_true",
                        help="also W on the base model on the --enable-lora server (config C)")
    parser.add_argument("--num-requests", type=int, default=256, help="W's requests, all submitted at once")
    parser.add_argument("--input-lens", default="64-256", metavar="MIN-MAX")
    parser.add_argument("--output-lens", default="32-256", metavar="MIN-MAX")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=6 << 30)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds a start or a W request may take")
    parser.add_argument("--adapter-dir", default=None, help="make (or reuse) the adapters here, kept "
                        "(default: a temp folder, removed)")
    parser.add_argument("--log-dir", default=None, help="each server's log (default: a new temp folder, kept)")
    parser.add_argument("--output-json", default=None, help="write the results here")


# ------------------------------------------------------------------------------------------------
# Pure parts (unit-tested)


def adapter_names(n: int) -> list[str]:
    return [f"lora{i}" for i in range(n)]


def assign_adapters(num_requests: int, names: list[str]) -> list[str]:
    """Request i runs on adapter i % len(names): every adapter in every step of W."""
    if not names:
        raise ValueError("no adapters to assign")
    return [names[i % len(names)] for i in range(num_requests)]


def lora_serve_args(adapters: dict[str, Path], rank: int) -> list[str]:
    """The flags of server B: every adapter served from the start, all of them allowed in a step."""
    modules = ",".join(f"{name}={path}" for name, path in adapters.items())
    return ["--enable-lora", "--max-loras", str(len(adapters)), "--max-cpu-loras", str(len(adapters)),
            "--max-lora-rank", str(rank), "--lora-modules", modules]


def schedule(runs: int) -> list[tuple[int, str]]:
    """(run, server) in order: base, lora, base, lora, ... (C, when asked, runs on each lora server)."""
    return [(i + 1, server) for i in range(runs) for server in ("base", "lora")]


def _median(values: list[float]) -> Optional[float]:
    return round(statistics.median(values), 2) if values else None


def _ratio(num: Optional[float], den: Optional[float]) -> Optional[float]:
    return round(num / den, 4) if num is not None and den else None


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per config medians (tok/s, TTFT, TPOT), ratios of medians to the base and paired ratios."""
    present = [c for c in CONFIGS if any(r["config"] == c for r in runs)]
    by = {c: sorted((r for r in runs if r["config"] == c), key=lambda r: r["run"]) for c in present}
    summary: dict[str, Any] = {"median_output_tok_s": {}, "median_ttft_ms": {}, "median_tpot_ms": {}}
    for c in present:
        summary["median_output_tok_s"][c] = _median([r["output_tok_s"] for r in by[c]])
        summary["median_ttft_ms"][c] = _median([r["median_ttft_ms"] for r in by[c]])
        summary["median_tpot_ms"][c] = _median([r["median_tpot_ms"] for r in by[c]])
    base = {r["run"]: r["output_tok_s"] for r in by.get("base", [])}
    for c in present:
        if c == "base":
            continue
        summary[f"ratio_{c}_over_base"] = _ratio(summary["median_output_tok_s"][c],
                                                 summary["median_output_tok_s"].get("base"))
        paired = [round(r["output_tok_s"] / base[r["run"]], 4) for r in by[c] if base.get(r["run"])]
        summary[f"paired_ratios_{c}"] = paired
        summary[f"median_paired_ratio_{c}"] = round(statistics.median(paired), 4) if paired else None
    ratio = summary.get("ratio_lora_over_base")
    summary["meets_bar"] = None if ratio is None else ratio >= BAR
    return summary


def table(runs: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    """The Markdown table docs/benchmarks quotes: every run, then the medians."""
    lines = ["| run | config | output tok/s | median TTFT ms | median TPOT ms | load avg |", "|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r['run']} | {r['config']} | {r['output_tok_s']} | {r['median_ttft_ms']} | "
                     f"{r['median_tpot_ms']} | {r['load_avg_at_start'][0]} |")
    for c, tok_s in summary["median_output_tok_s"].items():
        lines.append(f"| median | {c} | {tok_s} | {summary['median_ttft_ms'][c]} | "
                     f"{summary['median_tpot_ms'][c]} | |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# Adapters and servers


def make_adapters(model: str, folder: Path, names: list[str], rank: int, targets: list[str]) -> dict[str, Path]:
    """Random PEFT adapters of ``model`` in ``folder``/NAME (reused when already there)."""
    paths = {name: folder / name for name in names}
    if all((p / "adapter_model.safetensors").is_file() for p in paths.values()):
        return paths
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(model)
    kwargs = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    start = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent if kwargs else path), dtype=torch.float32, **kwargs)
    for seed, out in enumerate(paths.values(), start=1):
        torch.manual_seed(seed)
        config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
        wrapped = peft.get_peft_model(hf, config)
        wrapped.save_pretrained(out)
        hf = wrapped.unload()  # the base model again, for the next adapter
    logger.info("made %d adapters (rank %d, %s) in %s in %.1f s", len(paths), rank, ",".join(targets), folder,
                time.perf_counter() - start)
    return paths


@contextlib.contextmanager
def served(model: str, extra: list[str], log: Path, timeout: float) -> Iterator[str]:
    """``gridserve serve model`` (this interpreter's) until the block ends: yields its base URL."""
    with logged_server(sys.executable, model, ["--grace-period", "2", *extra], log, timeout) as url:
        yield url


def served_w(url: str, model_file: str, args: argparse.Namespace, adapters: Optional[list[str]]) -> dict:
    """Served W against ``url``: on the base model (``adapters`` None) or request i on adapter i % N.

    ``bench default-model``'s ``_served_w`` with the model named per request: the requests carry
    their adapter's name, and the endpoint puts it in each body's ``model``."""
    from dataclasses import dataclass

    from gridserve.benchmarks.datasets import BenchRequest, TokenizerVocabulary, uniform_requests
    from gridserve.benchmarks.default_model_bench import _lens
    from gridserve.benchmarks.serve import Endpoint, LoadSpec, measure_run, model_card, probe

    @dataclass(frozen=True)
    class NamedRequest(BenchRequest):
        model: str = ""

    class PerRequestModel(Endpoint):
        def payload(self, request: BenchRequest) -> dict[str, Any]:
            body = super().payload(request)
            if getattr(request, "model", ""):
                body["model"] = request.model
            return body

    requests = uniform_requests(args.num_requests, TokenizerVocabulary(model_file), _lens(args.input_lens),
                                _lens(args.output_lens), seed=0)
    if adapters:
        requests = [NamedRequest(r.prompt, r.prompt_len, r.output_len, name)
                    for r, name in zip(requests, assign_adapters(len(requests), adapters))]
    endpoint = PerRequestModel(url, model=model_card(url, None)["id"])
    for warm_up in requests[:len(adapters) if adapters else 1]:  # every adapter loaded before the timed run
        warm = probe(endpoint, warm_up, args.timeout)
        if not warm.success:
            raise RuntimeError(f"the warm-up request failed: {warm.error}")
    run = measure_run(endpoint, requests, LoadSpec(max_concurrency=len(requests), timeout_s=args.timeout,
                                                   max_duration_s=args.timeout, progress=False))
    if run.get("failed"):
        raise RuntimeError(f"{run['failed']} of {len(requests)} requests failed: {run.get('errors')}")
    keys = ("completed", "failed", "duration", "output_throughput", "median_ttft_ms", "median_tpot_ms", "load_avg")
    return {k: run.get(k) for k in keys}


def _row(run: int, config: str, w: dict, load: tuple[float, ...]) -> dict[str, Any]:
    row = {"run": run, "config": config, "output_tok_s": round(w["output_throughput"], 1),
           "median_ttft_ms": round(w["median_ttft_ms"], 1), "median_tpot_ms": round(w["median_tpot_ms"], 2),
           "load_avg_at_start": [round(x, 2) for x in load], "served_w": w}
    logger.info("  %s: %.1f output tok/s, TTFT %.0f ms, TPOT %.1f ms (%d completed, load %.2f)", config,
                row["output_tok_s"], row["median_ttft_ms"], row["median_tpot_ms"], w["completed"], load[0])
    return row


def run(args: argparse.Namespace) -> int:
    from gridserve.default_model import default_model_file

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx2").setLevel(logging.WARNING)  # not a line per request
    # SIGTERM (a timeout, an operator) unwinds like Ctrl-C: the servers' ``finally`` stops them.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    model = args.model or str(default_model_file())
    names = adapter_names(args.num_adapters)
    targets = [t for t in args.targets.split(",") if t]
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="gridserve-bench-lora-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    logger.info("server logs: %s", log_dir)
    common = ["--max-model-len", str(args.max_model_len), "--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes)]
    with contextlib.ExitStack() as stack:
        folder = (Path(args.adapter_dir) if args.adapter_dir else
                  Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gridserve-bench-lora-adapters-"))))
        adapters = make_adapters(model, folder, names, args.rank, targets)
        extra = {"base": common, "lora": common + lora_serve_args(adapters, args.rank)}
        result: dict[str, Any] = {
            "benchmark": "lora", "model": args.model or "default (SmolLM2-135M-Instruct Q4_1 GGUF)",
            "cpus": os.cpu_count(), "adapters": {"count": len(names), "rank": args.rank, "lora_alpha": 2 * args.rank,
                                                 "targets": targets},
            "workload": {"num_requests": args.num_requests, "input_lens": args.input_lens,
                         "output_lens": args.output_lens, "ignore_eos": True, "temperature": 0.0},
            "serve_args": extra, "log_dir": str(log_dir), "runs": []}
        for i, server in schedule(args.runs):
            load = os.getloadavg()
            logger.info("run %d, %s server, load %.2f", i, server, load[0])
            with served(model, extra[server], log_dir / f"serve-{i}-{server}.log", args.timeout) as url:
                w = served_w(url, model, args, names if server == "lora" else None)
                result["runs"].append(_row(i, server, w, load))
                if server == "lora" and args.with_base_on_lora_server:
                    load = os.getloadavg()
                    w = served_w(url, model, args, None)
                    result["runs"].append(_row(i, "base_on_lora_server", w, load))
    result["summary"] = summarize(result["runs"])
    print(json.dumps(result, indent=2))
    print()
    print(table(result["runs"], result["summary"]))
    s = result["summary"]
    print(f"\nlora / base: {s.get('ratio_lora_over_base')}x (median of paired ratios "
          f"{s.get('median_paired_ratio_lora')}x); bar >= {BAR}x: {'met' if s['meets_bar'] else 'NOT met'}")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2) + "\n")
    return 0
