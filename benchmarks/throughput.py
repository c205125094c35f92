"""``gridserve bench throughput``: offline throughput of gridserve against transformers ``generate``.

One run measures, on the same request set:

``gridserve``
    ``LLM.generate`` on all requests at once (continuous batching), greedy,
    ``SamplingParams(temperature=0, max_tokens=L, ignore_eos=True)`` per request.
``hf_batched``
    ``AutoModelForCausalLM.generate`` on batches of ``--hf-batch-size`` requests, left-padded with
    the tokenizer's pad token, greedy, every row running to the batch's longest wanted output
    (``max_new_tokens = min_new_tokens = max(L)``; EOS is disabled to mirror ``ignore_eos``).
``hf_single`` (optional, ``--hf-single N``)
    ``generate`` one request at a time on the first ``N`` requests.

Only each request's own wanted output tokens count as useful output (the sum of the output
lengths), for every system; the tokens an HF batch generates past a request's length are waste.
Prompts are random token ids (special ids excluded), so no tokenizer runs on the prompt side.

The report is a table on stdout and a JSON file (``--output-json``) with every figure, the
configuration, library versions and timestamps. How many gridserve greedy outputs are
token-identical to transformers' is reported as information: left padding and different batch
shapes change float rounding, and a random model's near-tied logits turn that into a different
argmax now and then, so a mismatch is not a failure.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import functools
import gc
import json
import logging
import math
import os
import platform
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from gridserve.shared import envs

logger = logging.getLogger(__name__)

#: Ids 0..5 are the recipe tokenizer's special tokens (unk, bos, eos, pad, im_start, im_end).
FIRST_REGULAR_TOKEN_ID = 6
DEFAULT_OUTPUT_JSON = "benchmarks/results/throughput.json"
BASELINE = "hf_batched"


# --------------------------------------------------------------------------------------------
# Workload


@dataclass(frozen=True)
class Workload:
    """The request set every system runs: prompt token ids and the wanted output length of each."""

    prompt_token_ids: list[list[int]]
    output_lens: list[int]
    seed: int

    def __post_init__(self) -> None:
        if len(self.prompt_token_ids) != len(self.output_lens):
            raise ValueError(
                f"{len(self.prompt_token_ids)} prompts but {len(self.output_lens)} output lengths"
            )

    @property
    def num_requests(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def prompt_lens(self) -> list[int]:
        return [len(p) for p in self.prompt_token_ids]

    @property
    def total_prompt_tokens(self) -> int:
        return sum(self.prompt_lens)

    @property
    def total_output_tokens(self) -> int:
        return sum(self.output_lens)

    def head(self, n: int) -> Workload:
        """The first ``n`` requests (all of them when ``n`` is larger)."""
        return Workload(self.prompt_token_ids[:n], self.output_lens[:n], self.seed)

    def describe(self) -> dict[str, Any]:
        """Sizes for the report (not the token ids themselves)."""
        return {
            "num_requests": self.num_requests,
            "seed": self.seed,
            "total_prompt_tokens": self.total_prompt_tokens,
            "total_output_tokens": self.total_output_tokens,
            "prompt_len_min": min(self.prompt_lens, default=0),
            "prompt_len_max": max(self.prompt_lens, default=0),
            "output_len_min": min(self.output_lens, default=0),
            "output_len_max": max(self.output_lens, default=0),
        }


def make_workload(
    num_prompts: int,
    input_len_min: int,
    input_len_max: int,
    output_len_min: int,
    output_len_max: int,
    vocab_size: int,
    seed: int = 0,
    first_token_id: int = FIRST_REGULAR_TOKEN_ID,
) -> Workload:
    """Random prompts (ids uniform in ``[first_token_id, vocab_size)``) and output lengths.

    Prompt and output lengths are uniform in their inclusive ranges; the same arguments always
    give the same workload (a private ``random.Random(seed)``).
    """
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    for name, lo, hi in (("input", input_len_min, input_len_max), ("output", output_len_min, output_len_max)):
        if lo < 1 or hi < lo:
            raise ValueError(f"{name} lengths need 1 <= min <= max, got [{lo}, {hi}]")
    if vocab_size <= first_token_id:
        raise ValueError(f"vocab_size {vocab_size} leaves no ids at or above {first_token_id}")
    rng = random.Random(seed)
    prompt_lens = [rng.randint(input_len_min, input_len_max) for _ in range(num_prompts)]
    output_lens = [rng.randint(output_len_min, output_len_max) for _ in range(num_prompts)]
    prompts = [[rng.randrange(first_token_id, vocab_size) for _ in range(n)] for n in prompt_lens]
    return Workload(prompts, output_lens, seed)


def batches(n: int, batch_size: int) -> Iterator[range]:
    """Consecutive index ranges of at most ``batch_size`` covering ``range(n)``."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    for start in range(0, n, batch_size):
        yield range(start, min(start + batch_size, n))


def generated_tokens_batched(output_lens: Sequence[int], batch_size: int) -> int:
    """Tokens an HF batch loop generates in all (each row runs to its batch's longest output)."""
    return sum(len(b) * max(output_lens[i] for i in b) for b in batches(len(output_lens), batch_size))


# --------------------------------------------------------------------------------------------
# Results and summary


@dataclass
class SystemResult:
    """One system's timed run: the useful output tokens, wall seconds and the outputs themselves."""

    name: str
    num_requests: int
    output_tokens: int  # useful ones: the sum of the wanted output lengths
    elapsed_s: float  # wall seconds of the timed part
    outputs: list[list[int]] = field(default_factory=list, repr=False)
    generated_tokens: Optional[int] = None  # all tokens produced, padding waste included
    setup_s: Optional[float] = None  # model load (not timed)
    started_at: str = ""
    finished_at: str = ""
    # CPU seconds this process used in the timed part, and the 1-minute load average around it:
    # on a shared machine, wall time alone cannot tell a slow system from a busy host.
    cpu_s: Optional[float] = None
    load_avg: Optional[tuple[float, float]] = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def output_tok_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s if self.elapsed_s > 0 else float("nan")


def summarize(results: Sequence[SystemResult], baseline: str = BASELINE) -> list[dict[str, Any]]:
    """One row per system: requests, output tokens, seconds, output tok/s and the ratio of its tok/s
    to the baseline's (``None`` when the baseline did not run or has no throughput)."""
    by_name = {r.name: r for r in results}
    base = by_name.get(baseline)
    base_tps = base.output_tok_per_s if base is not None else None
    rows = []
    for r in results:
        tps = r.output_tok_per_s
        ratio = tps / base_tps if base_tps and math.isfinite(base_tps) and math.isfinite(tps) else None
        rows.append({
            "system": r.name,
            "requests": r.num_requests,
            "output_tokens": r.output_tokens,
            "seconds": r.elapsed_s,
            "cpu_seconds": r.cpu_s,
            "output_tok_per_s": tps,
            f"ratio_vs_{baseline}": ratio,
        })
    return rows


def format_table(rows: Sequence[dict[str, Any]], baseline: str = BASELINE) -> str:
    """The summary rows as a fixed-width text table."""
    header = ("system", "requests", "output tokens", "seconds", "output tok/s", f"vs {baseline}",
              "cpu s")
    lines = [header]
    for row in rows:
        ratio = row.get(f"ratio_vs_{baseline}")
        lines.append((
            str(row["system"]),
            str(row["requests"]),
            str(row["output_tokens"]),
            f"{row['seconds']:.2f}",
            f"{row['output_tok_per_s']:.1f}",
            f"{ratio:.2f}x" if ratio is not None else "-",
            f"{row['cpu_seconds']:.1f}" if row.get("cpu_seconds") is not None else "-",
        ))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]

    def fmt(line: Sequence[str]) -> str:
        first = line[0].ljust(widths[0])
        return "  ".join([first, *(cell.rjust(w) for cell, w in zip(line[1:], widths[1:]))])

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([fmt(lines[0]), rule, *(fmt(line) for line in lines[1:])])


def compare_outputs(
    ours: Sequence[Sequence[int]], theirs: Sequence[Sequence[int]], output_lens: Sequence[int]
) -> dict[str, Any]:
    """How far two systems' greedy outputs agree, over the requests both have.

    Each output is cut to the request's wanted length first. Returns the number compared, how
    many are token-identical, that fraction, and the mean fraction of tokens before the first
    difference (1.0 for identical outputs).
    """
    n = min(len(ours), len(theirs), len(output_lens))
    identical, prefix_fracs = 0, []
    for a, b, want in zip(ours[:n], theirs[:n], output_lens[:n]):
        a, b = list(a[:want]), list(b[:want])
        if a == b:
            identical += 1
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix_fracs.append(same / want if want else 1.0)
    return {
        "compared": n,
        "identical": identical,
        "match_fraction": identical / n if n else None,
        "mean_common_prefix_fraction": sum(prefix_fracs) / n if n else None,
    }


# --------------------------------------------------------------------------------------------
# The systems


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _load_avg() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:  # pragma: no cover - not available on this platform
        return float("nan")


class _Timed:
    """Times a block: wall and process CPU seconds, UTC timestamps, load average before / after."""

    def __enter__(self) -> _Timed:
        self.started_at, self.load_start = _now(), _load_avg()
        self._cpu0, self._t0 = time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.elapsed_s = time.perf_counter() - self._t0
        self.cpu_s = time.process_time() - self._cpu0
        self.finished_at, self.load_end = _now(), _load_avg()

    def fields(self) -> dict[str, Any]:
        """The ``SystemResult`` fields this block measured."""
        return {"elapsed_s": self.elapsed_s, "cpu_s": self.cpu_s, "started_at": self.started_at,
                "finished_at": self.finished_at, "load_avg": (self.load_start, self.load_end)}


def run_gridserve(
    model: str,
    workload: Workload,
    *,
    dtype: str = "float32",
    device: str = "auto",
    max_num_seqs: int = 256,
    max_num_batched_tokens: Optional[int] = None,
    kv_cache_memory_bytes: Optional[int] = None,
    name: str = "gridserve",
    profile: int = 0,
    **engine_kwargs: Any,
) -> SystemResult:
    """``LLM.generate`` on the whole workload in one call (after an untimed warm-up).

    ``engine_kwargs`` go to ``LLM`` as they are (e.g. ``quantization``, ``kv_cache_dtype``).
    ``profile``: after the timed run, the workload once more under ``torch.profiler``; the ``profile``
    ops with the most self CPU time go into ``extra["profile"]`` (the timed run is not profiled).
    """
    from gridserve import LLM, SamplingParams

    kwargs: dict[str, Any] = {"dtype": dtype, "device": device, "max_num_seqs": max_num_seqs, **engine_kwargs}
    if max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = max_num_batched_tokens
    if kv_cache_memory_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = kv_cache_memory_bytes
    t0 = time.perf_counter()
    llm = LLM(model=model, **kwargs)
    setup_s = time.perf_counter() - t0
    try:
        _warm_up_gridserve(llm, workload, SamplingParams)
        prompts = [{"prompt_token_ids": ids} for ids in workload.prompt_token_ids]
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload.output_lens]
        with _Timed() as timed:
            results = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats()
        rerun = functools.partial(_generate_uncached, llm, prompts, params)
        top_ops = profile_ops(rerun, profile) if profile else None
    finally:
        llm.shutdown()
        del llm
        gc.collect()
    outputs = [list(r.outputs[0].token_ids) for r in results]
    short = [i for i, (o, n) in enumerate(zip(outputs, workload.output_lens)) if len(o) != n]
    if short:
        logger.warning("gridserve: %d requests did not produce their wanted length (first: #%d)",
                       len(short), short[0])
    return SystemResult(
        name=name,
        num_requests=workload.num_requests,
        output_tokens=workload.total_output_tokens,
        outputs=outputs,
        generated_tokens=sum(len(o) for o in outputs),
        setup_s=setup_s,
        **timed.fields(),
        extra={"num_preemptions": stats.num_preemptions, "engine_kwargs": kwargs,
               **({"profile": top_ops} if top_ops is not None else {})},
    )


def _generate_uncached(llm: Any, prompts: list[Any], params: list[Any]) -> Any:
    """``generate`` with the prefix cache emptied first: a rerun computes its prompts again, as the
    timed run did (otherwise every prompt would be a cache hit and the profile would have no prefill)."""
    llm.reset_prefix_cache()
    return llm.generate(prompts, params, use_tqdm=False)


def profile_ops(fn: Callable[[], Any], top: int) -> dict[str, Any]:
    """Run ``fn`` under ``torch.profiler`` (CPU): its wall time and the ``top`` ops by self CPU time
    (the calling thread's, where the forward runs in-process), each with its share of the wall."""
    from torch.profiler import ProfilerActivity, profile

    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    wall = time.perf_counter() - start
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    ops = [{"op": e.key, "calls": e.count, "self_s": e.self_cpu_time_total / 1e6,
            "share": e.self_cpu_time_total / 1e6 / wall} for e in events]
    return {"wall_s": wall, "ops": ops}


def format_profile(profile: dict[str, Any]) -> str:
    lines = [f"where the time goes (a profiled rerun, {profile['wall_s']:.1f} s):",
             "| op | calls | self s | share of wall |", "|---|---|---|---|"]
    lines += [f"| {o['op']} | {o['calls']} | {o['self_s']:.1f} | {100 * o['share']:.1f}% |" for o in profile["ops"]]
    return "\n".join(lines)


def _warm_up_gridserve(llm: Any, workload: Workload, sampling_params_cls: Any) -> None:
    prompts = [{"prompt_token_ids": ids[:16]} for ids in workload.prompt_token_ids[:2]]
    llm.generate(prompts, sampling_params_cls(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)


def load_hf(model: str, dtype: str = "float32", device: str = "cpu") -> tuple[Any, Any]:
    """The transformers model (eval mode) and a left-padding tokenizer for ``model``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model, padding_side="left")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    hf_model = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype)).to(device).eval()
    return hf_model, tokenizer


def _hf_generate(hf_model: Any, tokenizer: Any, prompts: Sequence[Sequence[int]], new_tokens: int) -> list[list[int]]:
    """Greedy ``generate`` on one left-padded batch; returns each row's new tokens."""
    import torch

    enc = tokenizer.pad({"input_ids": [list(p) for p in prompts]}, padding=True, return_tensors="pt")
    enc = {k: v.to(hf_model.device) for k, v in enc.items()}
    with torch.inference_mode():
        out = hf_model.generate(
            **enc,
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=None,  # mirror gridserve's ignore_eos: never stop, never mask EOS
        )
    return out[:, enc["input_ids"].shape[1]:].tolist()


def run_hf_batched(hf_model: Any, tokenizer: Any, workload: Workload, batch_size: int = 64) -> SystemResult:
    """transformers ``generate`` on batches of ``batch_size`` (after an untimed warm-up)."""
    _hf_generate(hf_model, tokenizer, [ids[:16] for ids in workload.prompt_token_ids[:2]], 4)
    outputs: list[list[int]] = []
    with _Timed() as timed:
        for batch in batches(workload.num_requests, batch_size):
            longest = max(workload.output_lens[i] for i in batch)
            rows = _hf_generate(hf_model, tokenizer, [workload.prompt_token_ids[i] for i in batch], longest)
            outputs.extend(rows)
            logger.info("hf_batched: batch of %d done (%d new tokens each)", len(batch), longest)
    return SystemResult(
        name="hf_batched",
        num_requests=workload.num_requests,
        output_tokens=workload.total_output_tokens,
        outputs=[o[:n] for o, n in zip(outputs, workload.output_lens)],
        generated_tokens=generated_tokens_batched(workload.output_lens, batch_size),
        **timed.fields(),
        extra={"batch_size": batch_size},
    )


def run_hf_single(hf_model: Any, tokenizer: Any, workload: Workload) -> SystemResult:
    """transformers ``generate`` one request at a time, each with exactly its own output length."""
    _hf_generate(hf_model, tokenizer, [workload.prompt_token_ids[0][:16]], 4)
    outputs: list[list[int]] = []
    with _Timed() as timed:
        for ids, n in zip(workload.prompt_token_ids, workload.output_lens):
            outputs.extend(_hf_generate(hf_model, tokenizer, [ids], n))
    return SystemResult(
        name="hf_single",
        num_requests=workload.num_requests,
        output_tokens=workload.total_output_tokens,
        outputs=outputs,
        generated_tokens=workload.total_output_tokens,
        **timed.fields(),
    )


# --------------------------------------------------------------------------------------------
# CLI


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The offline workload's shape (``Workload``): requests, prompt and output lengths, seed."""
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len-min", type=int, default=32)
    parser.add_argument("--input-len-max", type=int, default=256)
    parser.add_argument("--output-len-min", type=int, default=16)
    parser.add_argument("--output-len-max", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``gridserve bench throughput``."""
    parser.add_argument("--model", default=None,
                        help="HF folder (default: the recipe's llama 'base' checkpoint, built if missing)")
    add_workload_arguments(parser)
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--hf-single", type=int, default=0, metavar="N",
                        help="also run transformers one request at a time on the first N requests")
    parser.add_argument("--skip-hf", action="store_true", help="run gridserve only (no transformers)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                        help="gridserve KV cache size (default: enough for the whole workload at once)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: the core count)")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after the timed run, run gridserve's workload again under torch.profiler "
                             "and print (and save) its top N ops by self CPU time")
    parser.add_argument("--output-json", default=DEFAULT_OUTPUT_JSON)


def cpu_count() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def kv_cache_bytes_for(workload: Workload, model: str, block_size: int = 16, headroom: float = 1.25) -> int:
    """KV bytes that hold every request of ``workload`` at full length at once (with headroom)."""
    from gridserve.shared.config import ModelConfig

    cfg = ModelConfig(model=model).resolve()
    blocks = sum(-(-(p + o) // block_size) for p, o in zip(workload.prompt_lens, workload.output_lens))
    blocks = max(blocks, -(-cfg.max_model_len // block_size))  # the engine wants one full-length request
    return int((blocks + 2) * block_size * cfg.kv_bytes_per_token() * headroom)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by ``args``; print the table, write the JSON. Returns 0."""
    import torch
    import transformers

    started_at = _now()
    threads = args.threads or envs.GRIDSERVE_CPU_THREADS or cpu_count()
    torch.set_num_threads(threads)
    os.environ["GRIDSERVE_CPU_THREADS"] = str(threads)  # the gridserve worker reads it
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")

    model = args.model
    if model is None:
        from gridserve.demo.recipe import ensure_checkpoint

        model = str(ensure_checkpoint("llama", "base"))
    vocab_size = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    workload = make_workload(
        args.num_prompts, args.input_len_min, args.input_len_max,
        args.output_len_min, args.output_len_max, vocab_size, args.seed,
    )
    kv_bytes = args.kv_cache_memory_bytes or kv_cache_bytes_for(workload, model)
    logger.info("workload: %s; model %s; %d threads; device %s", workload.describe(), model, threads, device)

    results: list[SystemResult] = []
    logger.info("running gridserve ...")
    results.append(run_gridserve(
        model, workload, dtype=args.dtype, device=device, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory_bytes=kv_bytes,
        profile=args.profile,
    ))
    logger.info("gridserve: %.2fs", results[-1].elapsed_s)
    hf_setup_s = None
    if not args.skip_hf:
        t0 = time.perf_counter()
        hf_model, tokenizer = load_hf(model, args.dtype, device)
        hf_setup_s = time.perf_counter() - t0
        logger.info("running transformers batched (batch size %d) ...", args.hf_batch_size)
        results.append(run_hf_batched(hf_model, tokenizer, workload, args.hf_batch_size))
        results[-1].setup_s = hf_setup_s
        if args.hf_single > 0:
            logger.info("running transformers one request at a time (%d requests) ...", args.hf_single)
            results.append(run_hf_single(hf_model, tokenizer, workload.head(args.hf_single)))
            results[-1].setup_s = hf_setup_s
        del hf_model
        gc.collect()

    rows = summarize(results)
    by_name = {r.name: r for r in results}
    agreement = {}
    for other in ("hf_batched", "hf_single"):
        if other in by_name:
            agreement[f"gridserve_vs_{other}"] = compare_outputs(
                by_name["gridserve"].outputs, by_name[other].outputs, workload.output_lens
            )

    print()
    print(f"Offline throughput: {workload.num_requests} requests, prompts {args.input_len_min}.."
          f"{args.input_len_max}, outputs {args.output_len_min}..{args.output_len_max} tokens "
          f"(seed {args.seed}), {Path(model).name}, {args.dtype}, {device}, {threads} threads")
    print(format_table(rows))
    if "profile" in by_name["gridserve"].extra:
        print(format_profile(by_name["gridserve"].extra["profile"]))
    loads = ", ".join(f"{r.name} {r.load_avg[0]:.1f}->{r.load_avg[1]:.1f}" for r in results if r.load_avg)
    print(f"host: {cpu_count()} cores, 1-min load average before->after each run: {loads}")
    if "hf_single" in by_name:
        print(f"(hf_single ran on the first {by_name['hf_single'].num_requests} requests only)")
    for name, info in agreement.items():
        print(f"greedy agreement {name}: {info['identical']}/{info['compared']} token-identical "
              f"(mean common prefix {info['mean_common_prefix_fraction']:.0%}; informational)")
    print()

    report = {
        "benchmark": "throughput",
        "started_at": started_at,
        "finished_at": _now(),
        "config": {
            **{k: v for k, v in vars(args).items() if not callable(v)},
            "model": model,
            "device": device,
            "threads": threads,
            "kv_cache_memory_bytes": kv_bytes,
        },
        "workload": workload.describe(),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
            "gridserve": _gridserve_version(),
        },
        "host": {"machine": platform.machine(), "cpu_count": cpu_count(), "platform": platform.platform()},
        "summary": rows,
        "systems": [{k: v for k, v in asdict(r).items() if k != "outputs"} | {
            "output_tok_per_s": r.output_tok_per_s} for r in results],
        "greedy_agreement": agreement,
    }
    out_path = Path(args.output_json)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    logger.info("wrote %s", out_path)
    return 0


def _gridserve_version() -> str:
    from gridserve import __version__

    return __version__
