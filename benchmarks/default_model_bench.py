"""``gridserve bench default-model``: the default model as a newcomer meets it, timed.

**Start-up**: seconds from spawning ``gridserve serve`` (all roles and Envoy) to its
``gridserve ready`` line. The first start is **cold**: an empty torch-extensions folder
(``TORCH_EXTENSIONS_DIR``), so the C++ CPU kernels are compiled, and (where this process may) the
page cache dropped, so the checkpoint is read from disk. The later starts are **warm**: kernels
built, file cached; their median is reported. A GGUF is dequantized at every start (there is no
converted copy to reuse), so a warm start includes that.

**Served W** (docs/benchmarks: 256 requests at once, prompts 64-256 tokens, outputs 32-256,
``ignore_eos``, greedy) through the edge, one server per precision, each stopped before the next:
``fp32`` (the GGUF dequantized to float32) and ``int8`` (``--quantization int8 --kv-cache-dtype
bfloat16``). Output tokens per second, TTFT and TPOT medians.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

PRECISIONS = {"fp32": [], "int8": ["--quantization", "int8", "--kv-cache-dtype", "bfloat16"]}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model to serve (default: the default model, SmolLM2)")
    parser.add_argument("--warm-starts", type=int, default=3, help="warm starts after the cold one (median)")
    parser.add_argument("--precisions", default=",".join(PRECISIONS), help=f"served W runs: {', '.join(PRECISIONS)}")
    parser.add_argument("--num-prompts", type=int, default=256, help="W's requests, all submitted at once")
    parser.add_argument("--input-lens", default="64-256", metavar="MIN-MAX")
    parser.add_argument("--output-lens", default="32-256", metavar="MIN-MAX")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=6 << 30)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds a start or a W request may take")
    parser.add_argument("--output-json", default=None, help="write the results here")


def _drop_page_cache() -> bool:
    """Drop clean page-cache pages (root on Linux); False when this process may not."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return True
    except OSError:
        return False


@contextlib.contextmanager
def served(model: str | None, extra: list[str], extensions_dir: Path, timeout: float) -> Iterator[tuple[str, float]]:
    """``gridserve serve`` until the block ends: yields (base URL, seconds it took to get ready)."""
    from gridserve.launcher import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "gridserve.cli", "serve", *([model] if model else []), "--port", str(port),
           "--grace-period", "2", *extra]
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions_dir)}
    start = time.perf_counter()
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                              start_new_session=True, env=env)
    try:
        ready = None
        for line in server.stdout:
            if line.startswith("gridserve ready"):
                ready = time.perf_counter() - start
                break
            if time.perf_counter() - start > timeout:
                break
        if ready is None:
            raise RuntimeError(f"gridserve serve did not get ready (exit {server.poll()}): {' '.join(cmd)}")
        yield f"http://127.0.0.1:{port}", ready
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def _lens(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    return int(lo), int(hi or lo)


def _served_w(url: str, model_file: str, args: argparse.Namespace) -> dict:
    from gridserve.benchmarks.datasets import TokenizerVocabulary, uniform_requests
    from gridserve.benchmarks.serve import Endpoint, LoadSpec, measure_run, model_card, probe

    requests = uniform_requests(args.num_prompts, TokenizerVocabulary(model_file), _lens(args.input_lens),
                                _lens(args.output_lens), seed=0)
    endpoint = Endpoint(url, model=model_card(url, None)["id"])
    warm = probe(endpoint, requests[0], args.timeout)
    if not warm.success:
        raise RuntimeError(f"the warm-up request failed: {warm.error}")
    run = measure_run(endpoint, requests, LoadSpec(max_concurrency=len(requests), timeout_s=args.timeout,
                                                   max_duration_s=3600.0, progress=False))
    keys = ("completed", "failed", "duration", "output_throughput", "median_ttft_ms", "median_tpot_ms", "load_avg")
    return {k: run.get(k) for k in keys}


def run(args: argparse.Namespace) -> int:
    from gridserve.default_model import default_model_file

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    model_file = args.model or str(default_model_file())
    common = ["--max-model-len", str(args.max_model_len), "--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes)]
    result: dict = {"benchmark": "default-model", "model": args.model or "default (SmolLM2-135M-Instruct Q4_1 GGUF)",
                    "cpus": os.cpu_count(), "load_average_at_start": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory(prefix="gridserve-bench-ext-") as ext:
        dropped = _drop_page_cache()
        with served(args.model, common, Path(ext), args.timeout) as (_, cold):
            pass
        logger.info("cold start: %.1f s (page cache dropped: %s)", cold, dropped)
        warm = []
        for i in range(args.warm_starts):
            with served(args.model, common, Path(ext), args.timeout) as (_, seconds):
                warm.append(seconds)
            logger.info("warm start %d: %.1f s", i + 1, seconds)
        result["startup"] = {"cold_s": round(cold, 2), "cold_page_cache_dropped": dropped,
                             "warm_s": [round(w, 2) for w in warm],
                             "warm_median_s": round(statistics.median(warm), 2) if warm else None}
        result["served_w"] = {}
        for name in [p for p in args.precisions.split(",") if p]:
            if name not in PRECISIONS:
                raise ValueError(f"--precisions: unknown {name!r}; known: {', '.join(PRECISIONS)}")
            with served(args.model, common + PRECISIONS[name], Path(ext), args.timeout) as (url, _):
                result["served_w"][name] = _served_w(url, model_file, args)
            logger.info("served W %s: %.1f output tok/s", name, result["served_w"][name]["output_throughput"])
    print(json.dumps(result, indent=2))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2) + "\n")
    return 0
