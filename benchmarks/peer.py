"""``gridserve bench peer``: workload W on gridserve, vLLM's CPU build and llama.cpp's
``llama-server``, one run.

W is 256 requests submitted at once, prompts of 64-256 random token ids, outputs of 32-256 tokens
with ``ignore_eos`` (``--num-prompts``, ``--input-lens``, ``--output-lens`` shrink it for a smoke
run), on one checkpoint (default: SmolLM2-135M-Instruct, ``gridserve serve``'s default model: its
GGUF saved once as an HF folder by transformers, which every peer loads). Each variant
(:mod:`gridserve.benchmarks.peer_report`) gets its own server on free loopback ports, stopped
after its run whatever happens: gridserve through the launcher (worker, engine, gateway, Envoy),
``vllm serve`` from vLLM's CPU build, installed by the shared script when missing
(:mod:`vllm_server`), llama.cpp's ``llama-server`` on the checkpoint converted to GGUF
(:mod:`llama_server`). Settings are pinned alike: 8 GiB of KV cache, 256 sequences at most, 512
tokens of context (llama.cpp: ``-np N`` slots of 512). Every server is measured by the same
client, ``bench serve``'s, in the same way:

1. a short warm-up request (``bench serve``'s endpoint check);
2. greedy tokens of a few fixed prompts (``--greedy-prompts``: chat prompts through the model's
   chat template when it has one, else random token ids), sent as token ids: gridserve's through
   gRPC at the edge, vLLM's from ``/v1/completions`` with ``return_token_ids``, llama.cpp's from
   ``/completion`` with ``return_tokens``; compared with gridserve-fp32's (the fp32 variants must
   agree: vllm-fp32 and llama.cpp entirely in fp32);
3. W, with the latency probe (``--probe-rate``, one short request per second on its own
   connections) and the CPU seconds each process used meanwhile (``cpu_by_process``), by role:
   envoy, gateway, engine, worker, llama-server, the client (this process), other.

It prints one table row per variant, the ratios per precision pair (gridserve / vLLM and gridserve
/ llama.cpp's best ``-np``), CPU by role and greedy agreement, and writes them as JSON and a plot.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import logging
import os
import platform
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from gridserve.benchmarks.cpu_by_process import cpu_seconds, cpu_used, role
from gridserve.benchmarks.datasets import BenchRequest, TokenizerVocabulary, uniform_requests
from gridserve.benchmarks.llama_server import (
    LlamaServer,
    default_scripts_dir,
    default_work_dir,
    ensure_gguf,
    find_llama_server,
)
from gridserve.benchmarks.metrics import format_report
from gridserve.benchmarks.peer_report import (
    DEFAULT_VARIANTS,
    GRIDSERVE,
    LLAMA_CPP,
    VLLM,
    Variant,
    cpu_table,
    greedy_agreement,
    greedy_line,
    pair_ratios,
    pairs_table,
    parse_range,
    parse_variants,
    plot_peer,
    variant_dict,
    variants_table,
)
from gridserve.benchmarks.peer_server import PeerSetupError
from gridserve.benchmarks.serve import (
    Endpoint,
    LoadSpec,
    _load_avg,
    _now,
    latency_probe,
    measure_run,
    model_card,
    probe,
)
from gridserve.benchmarks.vllm_server import (
    VLLM_DTYPES,
    VllmServer,
    default_vllm_scripts_dir,
    default_vllm_venv,
    find_vllm,
)
from gridserve.shared.errors import GridserveError

logger = logging.getLogger(__name__)

GREEDY_SEED = 424242
GREEDY_PROMPT_LEN = 32
GREEDY_TIMEOUT_S = 300.0
GREEDY_FP32 = "lcpp-f32-kvf32-nofa-np1"  # llama.cpp entirely in fp32: the greedy check's peer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``gridserve bench peer``."""
    parser.add_argument("--model", default=None,
                        help="HF folder (default: SmolLM2-135M-Instruct from the default model's GGUF, saved as an "
                             "HF folder on first use; 'recipe': the recipe's Llama base)")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                        help="comma-separated: gridserve-fp32, gridserve-bf16, gridserve-int8, gridserve-int8-g32, gridserve-fp32-ngram, vllm-bf16, vllm-fp32, "
                             "lcpp-<f32|f16|q8_0>[-kv<T>]-np<N> "
                             f"(default: {','.join(DEFAULT_VARIANTS)})")
    w = parser.add_argument_group("workload (default: W)")
    w.add_argument("--num-prompts", type=int, default=256, help="requests, all submitted at once")
    w.add_argument("--input-lens", default="64-256", metavar="MIN-MAX", help="prompt tokens, uniform")
    w.add_argument("--output-lens", default="32-256", metavar="MIN-MAX", help="output tokens, uniform (ignore_eos)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--probe-rate", type=float, default=1.0,
                   help="latency probe: short requests per second while W runs (0: off)")
    w.add_argument("--probe-input-len", type=int, default=32)
    w.add_argument("--probe-output-len", type=int, default=4)
    w.add_argument("--greedy-prompts", type=int, default=8,
                   help="chat prompts (random token ids when the model has no chat template) whose greedy "
                        "tokens are compared with gridserve-fp32's (0: off)")
    w.add_argument("--greedy-tokens", type=int, default=32, help="greedy tokens per prompt")
    w.add_argument("--timeout", type=float, default=1800.0, help="seconds per request")
    w.add_argument("--max-duration", type=float, default=3600.0, help="seconds per W run, at most")
    g = parser.add_argument_group("gridserve and vLLM (pinned alike)")
    g.add_argument("--kv-cache-memory-bytes", type=int, default=8 << 30,
                   help="KV cache (8 GiB holds all of W; vLLM gets it in whole GiB)")
    g.add_argument("--max-num-seqs", type=int, default=256, help="sequences per step at most")
    g.add_argument("--max-model-len", type=int, default=512, help="tokens of context per sequence")
    v = parser.add_argument_group("vLLM")
    v.add_argument("--vllm", default=None, help="the vllm executable (default: VENV/bin/vllm, installed there first)")
    v.add_argument("--vllm-venv", default=None,
                   help=f"venv of vLLM's CPU build (default: {default_vllm_venv()}; installed by install.sh)")
    v.add_argument("--vllm-scripts", default=None,
                   help=f"folder of the shared install.sh (default: {default_vllm_scripts_dir()})")
    p = parser.add_argument_group("llama.cpp")
    p.add_argument("--llama-server", default=None,
                   help="the llama-server binary (default: on PATH, else built by the shared scripts)")
    p.add_argument("--llama-cpp-dir", default=None,
                   help=f"work dir of the shared scripts: build, converter venv, GGUF cache (default: {default_work_dir()})")
    p.add_argument("--peer-scripts", default=None,
                   help=f"folder of build.sh / convert.sh (default: $GRIDSERVE_PEER_SCRIPTS or {default_scripts_dir()})")
    p.add_argument("--ctx-per-slot", type=int, default=512, help="context tokens per llama.cpp slot (-c = slots x this)")
    p.add_argument("--threads", type=int, default=None, help="llama-server -t (default: every core)")
    out = parser.add_argument_group("output")
    out.add_argument("--output-json", default="benchmarks/results/peer.json")
    out.add_argument("--plot", default="benchmarks/results/peer.png", help="PNG ('' for none)")
    out.add_argument("--log-dir", default=None, help="server logs (default: LLAMA_CPP_DIR/logs/<time>)")
    out.add_argument("--disable-tqdm", action="store_true")


@dataclass
class Served:
    """A running server of one variant: its OpenAI root URL, pid -> role of its processes, how to
    get greedy tokens from it, and the command line that started it."""

    url: str
    roles: dict[int, str]
    greedy: Callable[[list[BenchRequest]], list[list[int]]]
    argv: list[str]


@dataclass
class PeerSetup:
    """What every variant's run needs, resolved once before the first server starts."""

    model: Path
    vocabulary: TokenizerVocabulary
    requests: list[BenchRequest]
    greedy_requests: list[BenchRequest]
    log_dir: Path
    llama_server: Optional[Path] = None
    ggufs: Optional[dict[str, Path]] = None
    vllm: Optional[Path] = None


def run(args: argparse.Namespace) -> int:
    logging.getLogger("httpx2").setLevel(logging.WARNING)
    variants = parse_variants(args.variants)
    setup = _setup(args, variants)
    started_at, load_before = _now(), _load_avg()
    results = [_run_variant(v, setup, args) for v in variants]
    tokens = {r["variant"]["name"]: r["greedy_tokens"] for r in results if r.get("greedy_tokens")}
    tokens |= _fp32_greedy(setup, args)
    fp32 = [GREEDY_FP32, *(v.name for v in variants if v.pair == "fp32")]  # fp32 weights: the tokens must agree
    w = _workload(setup.requests)
    report = {"benchmark": "peer", "model": str(setup.model), "workload": w, "started_at": started_at,
              "finished_at": _now(), "load_avg": [load_before, _load_avg()], "log_dir": str(setup.log_dir),
              "host": {"machine": platform.machine(), "cpu_count": os.cpu_count(), "platform": platform.platform()},
              "config": {k: v for k, v in vars(args).items() if not callable(v)},
              "variants": results, "pairs": pair_ratios(results), "greedy": greedy_agreement(tokens, compare=fp32)}
    print(f"\nW: {w['num_prompts']} requests at once, prompts {w['input_lens'][0]}-{w['input_lens'][1]}, "
          f"outputs {w['output_lens'][0]}-{w['output_lens'][1]} (ignore_eos); {setup.model}; "
          f"load average {load_before:.2f} -> {_load_avg():.2f}")
    print(variants_table(results), "", pairs_table(report["pairs"]), "", "CPU seconds by process during W:",
          cpu_table(results), "", greedy_line(report["greedy"]), sep="\n")
    for r in results:
        if r.get("error"):
            print(f"{r['variant']['name']}: failed: {r['error']}")
    _write(report, args)
    ok = all(not r.get("error") and r["run"]["failed"] == 0 for r in results)
    return 0 if ok else 1


def _setup(args: argparse.Namespace, variants: list[Variant]) -> PeerSetup:
    """The checkpoint, W's and the greedy prompts, and (when a llama.cpp variant runs) llama-server
    and every GGUF it needs: any build or conversion happens here, before the first measurement."""
    input_lens, output_lens = parse_range(args.input_lens, "--input-lens"), parse_range(args.output_lens, "--output-lens")
    if args.ctx_per_slot < input_lens[1] + output_lens[1]:
        raise ValueError(f"--ctx-per-slot {args.ctx_per_slot} is below the longest request "
                         f"({input_lens[1]} + {output_lens[1]} tokens)")
    if args.greedy_prompts < 0:
        raise ValueError(f"--greedy-prompts must be >= 0, got {args.greedy_prompts}")
    if args.greedy_tokens < 1:
        raise ValueError(f"--greedy-tokens must be >= 1, got {args.greedy_tokens}")
    model = (_recipe_base() if args.model == "recipe" else Path(args.model).expanduser() if args.model
             else smollm2_hf_folder())
    if not (model / "config.json").is_file():
        raise ValueError(f"--model {model}: not a Hugging Face checkpoint folder (no config.json)")
    vocabulary = TokenizerVocabulary(model)
    requests = uniform_requests(args.num_prompts, vocabulary, input_lens, output_lens, seed=args.seed)
    greedy = (chat_requests(model, args.greedy_prompts, args.greedy_tokens)
              or uniform_requests(args.greedy_prompts, vocabulary, (GREEDY_PROMPT_LEN,) * 2,
                                  (args.greedy_tokens,) * 2, seed=GREEDY_SEED)) if args.greedy_prompts else []
    if args.max_model_len < input_lens[1] + output_lens[1]:
        raise ValueError(f"--max-model-len {args.max_model_len} is below the longest request "
                         f"({input_lens[1]} + {output_lens[1]} tokens)")
    work_dir = Path(args.llama_cpp_dir).expanduser() if args.llama_cpp_dir else default_work_dir()
    log_dir = Path(args.log_dir) if args.log_dir else work_dir / "logs" / _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    setup = PeerSetup(model, vocabulary, requests, greedy, log_dir)
    if any(v.server == VLLM for v in variants):
        venv = Path(args.vllm_venv).expanduser() if args.vllm_venv else default_vllm_venv()
        scripts = Path(args.vllm_scripts) if args.vllm_scripts else default_vllm_scripts_dir()
        setup.vllm = find_vllm(args.vllm, venv, scripts)
    peers = [v for v in variants if v.server == LLAMA_CPP]
    if peers:
        scripts = Path(args.peer_scripts) if args.peer_scripts else default_scripts_dir()
        setup.llama_server = find_llama_server(args.llama_server, work_dir, scripts)
        setup.ggufs = {w: ensure_gguf(model, w, work_dir, scripts) for w in sorted({v.weights for v in peers})}
    logger.info("server logs in %s", log_dir)
    return setup


def smollm2_hf_folder() -> Path:
    """SmolLM2-135M-Instruct as an HF folder (cached in the model cache): the default model's GGUF
    read by transformers (dequantized to fp32) and saved with its tokenizer and chat template, so
    that gridserve, vLLM and llama.cpp all load the same weights."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gridserve.default_model import DEFAULT_MODEL_NAME, default_model_file
    from gridserve.demo.recipe import default_cache_dir

    out = default_cache_dir() / f"{DEFAULT_MODEL_NAME}-hf"
    if (out / "config.json").is_file():
        return out
    gguf = default_model_file()
    logger.info("saving %s as an HF folder in %s", gguf.name, out)
    partial = out.with_name(out.name + ".partial")
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model.hf_quantizer = None  # dequantized on load: the saved folder is plain fp32 safetensors
    model.config.quantization_config = None
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.replace(out)
    return out


def _recipe_base() -> Path:
    from gridserve.demo.recipe import ensure_checkpoint

    return Path(ensure_checkpoint("llama", "base"))


def _run_variant(variant: Variant, setup: PeerSetup, args: argparse.Namespace) -> dict[str, Any]:
    """Start the variant's server, warm it up, take greedy tokens, run W with the probe and the CPU
    count, stop the server. A variant that fails is recorded with its error; the others still run."""
    record: dict[str, Any] = {"variant": variant_dict(variant)}
    logger.info("variant %s", variant.name)
    try:
        with _serve(variant, setup, args) as served:
            record |= {"url": served.url, "server_argv": served.argv}
            endpoint = Endpoint(served.url, model=model_card(served.url, None)["id"])
            warm = probe(endpoint, setup.requests[0], args.timeout)
            if not warm.success:
                raise PeerSetupError(f"the warm-up request to {endpoint.url} failed: {warm.error}")
            if setup.greedy_requests:
                record["greedy_tokens"] = served.greedy(setup.greedy_requests)
            load = LoadSpec(max_concurrency=len(setup.requests), timeout_s=args.timeout,
                            max_duration_s=args.max_duration, seed=args.seed, progress=not args.disable_tqdm,
                            probe=latency_probe(args.probe_rate, setup.vocabulary,
                                                args.probe_input_len, args.probe_output_len, args.seed, False))
            before, start = cpu_seconds(), time.monotonic()
            record["run"] = measure_run(endpoint, setup.requests, load)
            record["cpu"] = cpu_by_role(before, cpu_seconds(), time.monotonic() - start, served.roles)
        print(format_report(record["run"], variant.name), flush=True)
    except (GridserveError, RuntimeError, TimeoutError, OSError, ValueError, KeyError) as exc:
        logger.error("variant %s failed: %s", variant.name, exc)
        record["error"] = f"{type(exc).__name__}: {exc}"
    return record


def _fp32_greedy(setup: PeerSetup, args: argparse.Namespace) -> dict[str, list[list[int]]]:
    """Greedy tokens from llama-server entirely in fp32, when the f32 GGUF is at hand: f32 weights
    and KV cache, flash attention off, one slot. The variants run llama.cpp as users do (f16 KV
    cache, flash attention on by default on CPU), whose rounding flips near-ties of the logits (on
    the recipe's base model, top-2 gaps of 0.02 were seen to flip), so exactness is checked here."""
    if not (setup.greedy_requests and setup.ggufs and "f32" in setup.ggufs):
        return {}
    try:
        with LlamaServer(setup.llama_server, setup.ggufs["f32"], 1, ctx_per_slot=args.ctx_per_slot, kv_type="f32",
                         threads=args.threads, log_path=setup.log_dir / f"{GREEDY_FP32}.log",
                         extra_args=("-fa", "off")) as server:
            return {GREEDY_FP32: llama_cpp_greedy(server.url, setup.greedy_requests)}
    except (GridserveError, RuntimeError, OSError, ValueError, KeyError) as exc:
        logger.error("the fp32 greedy check on llama.cpp failed: %s", exc)
        return {}


def cpu_by_role(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], wall_s: float,
                roles: dict[int, str], me: Optional[int] = None) -> dict[str, Any]:
    """CPU seconds between two ``cpu_seconds`` snapshots summed by role: ``roles`` names the
    server's processes (pid -> role), this process (``me``) is the client, the rest is ``other``
    (its three largest listed by command)."""
    me = os.getpid() if me is None else me
    by_role: dict[str, float] = defaultdict(float)
    others: dict[str, float] = defaultdict(float)
    for pid, (cmdline, seconds) in cpu_used(before, after).items():
        name = "client" if pid == me else roles.get(pid, "other")
        by_role[name] += seconds
        if name == "other":
            others[role(cmdline)] += seconds
    top = sorted(others.items(), key=lambda kv: -kv[1])[:3]
    return {"wall_s": round(wall_s, 1), "cores": os.cpu_count() or 1,
            "by_role": {k: round(v, 1) for k, v in sorted(by_role.items())},
            "other_top": [{"process": k, "cpu_s": round(v, 1)} for k, v in top]}


# ---- servers -------------------------------------------------------------------------------------


@contextlib.contextmanager
def _serve(variant: Variant, setup: PeerSetup, args: argparse.Namespace) -> Iterator[Served]:
    if variant.server == GRIDSERVE:
        with _gridserve(variant, setup, args) as served:
            yield served
        return
    if variant.server == VLLM:
        vllm = VllmServer(setup.vllm, setup.model, VLLM_DTYPES[variant.weights],
                          kv_cache_gib=max(1, round(args.kv_cache_memory_bytes / (1 << 30))),
                          max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                          log_path=setup.log_dir / f"{variant.name}.log")
        with vllm:
            yield Served(vllm.url, dict.fromkeys(vllm.pids(), "vllm"),
                         lambda requests: vllm_greedy(vllm.url, requests), vllm.argv())
        return
    server = LlamaServer(setup.llama_server, setup.ggufs[variant.weights], variant.slots,
                         ctx_per_slot=args.ctx_per_slot, kv_type=variant.kv, threads=args.threads,
                         log_path=setup.log_dir / f"{variant.name}.log")
    with server:
        yield Served(server.url, {server.process.pid: "llama-server"},
                     lambda requests: llama_cpp_greedy(server.url, requests), server.argv())


@contextlib.contextmanager
def _gridserve(variant: Variant, setup: PeerSetup, args: argparse.Namespace) -> Iterator[Served]:
    from gridserve.launcher import Launcher, free_port

    engine_args = [*variant.engine_args, "--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes),
                   "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len)]
    launcher = Launcher(str(setup.model), engine_args, edge_port=free_port(), log_dir=setup.log_dir / variant.name)
    try:
        launcher.start()
        roles = {p.pid: "envoy" if p.role == "edge" else p.role for p in launcher.processes}
        address = launcher.edge_address
        yield Served(f"http://{address}", roles, lambda requests: gridserve_greedy(address, requests),
                     ["gridserve serve", str(setup.model), *engine_args])
    finally:
        launcher.stop()


def gridserve_greedy(address: str, requests: list[BenchRequest]) -> list[list[int]]:
    """Greedy token ids of each request through gridserve's gRPC ``Generate`` at ``address``."""
    from gridserve.api.common.v1 import common_pb2
    from gridserve.api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
    from gridserve.shared.rpc.client import make_channel

    out = []
    with make_channel(address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        for r in requests:
            request = gateway_pb2.GenerateRequest(
                token_ids=gateway_pb2.TokenIds(ids=list(r.prompt)),
                sampling_params=common_pb2.SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True))
            out.append([t for message in stub.Generate(request, timeout=GREEDY_TIMEOUT_S) for t in message.token_ids])
    return out


def vllm_greedy(url: str, requests: list[BenchRequest]) -> list[list[int]]:
    """Greedy token ids of each request from vLLM's ``/v1/completions`` (a token-id prompt,
    ``return_token_ids``)."""
    import httpx2

    model = model_card(url, None)["id"]
    out = []
    for r in requests:
        body = {"model": model, "prompt": list(r.prompt), "max_tokens": r.output_len, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True, "stream": False}
        response = httpx2.post(url + "/v1/completions", json=body, timeout=GREEDY_TIMEOUT_S, trust_env=False)
        choices = response.json().get("choices") if response.status_code == 200 else None
        if not choices or choices[0].get("token_ids") is None:
            raise PeerSetupError(f"vllm /v1/completions: HTTP {response.status_code}: {response.text[:200]}")
        out.append([int(t) for t in choices[0]["token_ids"]])
    return out


def chat_requests(model: Path, count: int, output_len: int) -> list[BenchRequest]:
    """``count`` fixed chat questions through the model's chat template (``[]`` when it has none),
    as token-id prompts every server gets alike."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model))
    except (OSError, ValueError):
        return []
    if not getattr(tokenizer, "chat_template", None):
        return []
    out = []
    for i in range(count):
        question = CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)]
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                            tokenize=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        out.append(BenchRequest(prompt=ids, prompt_len=len(ids), output_len=output_len))
    return out


CHAT_QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than ten.",
    "How do plants make their food?",
    "Give me a short tip for learning a new language.",
    "What does a CPU do?",
    "Translate 'good morning' into Spanish.",
)


def llama_cpp_greedy(url: str, requests: list[BenchRequest]) -> list[list[int]]:
    """Greedy token ids of each request from llama-server's native ``/completion`` (``return_tokens``)."""
    import httpx2

    out = []
    for r in requests:
        body = {"prompt": list(r.prompt), "n_predict": r.output_len, "temperature": 0.0, "top_k": 1,
                "ignore_eos": True, "return_tokens": True, "cache_prompt": False, "stream": False}
        response = httpx2.post(url + "/completion", json=body, timeout=GREEDY_TIMEOUT_S, trust_env=False)
        if response.status_code != 200 or "tokens" not in response.json():
            raise PeerSetupError(f"llama-server /completion: HTTP {response.status_code}: {response.text[:200]}")
        out.append([int(t) for t in response.json()["tokens"]])
    return out


# ---- output --------------------------------------------------------------------------------------


def _workload(requests: list[BenchRequest]) -> dict[str, Any]:
    prompts = [r.prompt_len for r in requests]
    outputs = [r.output_len for r in requests]
    return {"num_prompts": len(requests), "ignore_eos": True, "all_at_once": True,
            "input_lens": [min(prompts), max(prompts)], "output_lens": [min(outputs), max(outputs)],
            "total_prompt_tokens": sum(prompts), "total_output_tokens": sum(outputs)}


def _write(report: dict[str, Any], args: argparse.Namespace) -> None:
    if args.output_json:
        path = Path(args.output_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2, default=str) + "\n")
        print(f"wrote {path}")
    if args.plot:
        print(f"wrote {plot_peer(report, args.plot)}")

