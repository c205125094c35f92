"""``gridserve bench executor``: what driving the worker over gRPC costs, against in-process.

One run builds an ``EngineCore`` twice on the same checkpoint and the same requests: once with
``UniProcExecutor`` (the worker in the engine's process) and once with ``GrpcExecutor`` (the worker
as a ``gridserve worker`` process on loopback, driven over its ``CollectiveRPC`` stream). Each
engine runs ``--num-prompts`` concurrent greedy requests (random prompt ids, ``--output-len``
tokens each, ``ignore_eos``) to completion after an untimed warm-up. Reported per executor: output
tokens/s, steps, median step time, and the median round trip of an empty call (``check_health``)
and of an empty ``execute_model`` step. The figure that matters is the grpc/uni throughput ratio
(the machine is shared and noisy; both runs happen back to back in one process).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Optional

from gridserve.launcher import free_port
from gridserve.shared.rpc.client import health_status, make_channel

logger = logging.getLogger(__name__)


@dataclass
class ExecutorResult:
    executor: str
    output_tokens: int
    elapsed_s: float
    steps: int
    median_step_ms: float
    median_call_rtt_ms: float
    median_empty_step_ms: float

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF folder (default: the recipe's llama 'small')")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=256 << 20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpu-threads", type=int, default=1,
                        help="torch threads of the worker on CPU, both executors (GRIDSERVE_CPU_THREADS); "
                             "1 avoids OpenMP stalls on a shared, loaded machine")
    parser.add_argument("--repeats", type=int, default=3, help="uni/grpc pairs, order alternating")
    parser.add_argument("--output-json", default=None, help="also write the figures to this file")


def run(args: argparse.Namespace) -> int:
    from gridserve.demo.recipe import ensure_checkpoint

    model = args.model or str(ensure_checkpoint("llama", "small"))
    os.environ["GRIDSERVE_CPU_THREADS"] = str(args.cpu_threads)  # read by Worker.init_device, here and in the worker process
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(6, 4000) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    with _worker_process() as worker:
        pairs = []
        for i in range(args.repeats):  # alternate the order: load on a shared machine drifts
            order = ["uni", "grpc"] if i % 2 == 0 else ["grpc", "uni"]
            runs = {name: _run_engine(name, model, prompts, args, [worker] if name == "grpc" else None)
                    for name in order}
            pairs.append((runs["uni"], runs["grpc"]))
    print(f"{'executor':<10}{'tok/s':>10}{'steps':>8}{'step ms':>10}{'call rtt ms':>13}{'empty step ms':>15}")
    for uni, grpc_ in pairs:
        for r in (uni, grpc_):
            print(f"{r.executor:<10}{r.tokens_per_s:>10.1f}{r.steps:>8}{r.median_step_ms:>10.2f}"
                  f"{r.median_call_rtt_ms:>13.3f}{r.median_empty_step_ms:>15.3f}")
    ratio = statistics.median(g.tokens_per_s / u.tokens_per_s for u, g in pairs)
    overhead = statistics.median(g.median_step_ms - u.median_step_ms for u, g in pairs)
    rtt = statistics.median(g.median_empty_step_ms for _, g in pairs)
    print(f"grpc/uni throughput ratio (median of {len(pairs)} pairs): {ratio:.3f}; "
          f"median step {overhead:+.2f} ms; empty execute_model round trip {rtt:.3f} ms")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"model": model, "args": vars(args), "ratio": ratio, "step_overhead_ms": overhead,
                       "empty_step_rtt_ms": rtt,
                       "runs": [asdict(r) | {"tokens_per_s": r.tokens_per_s} for pair in pairs for r in pair]},
                      f, indent=2)
    return 0


@contextlib.contextmanager
def _worker_process() -> Iterator[str]:
    """A ``gridserve worker`` on a free loopback port; yields its address."""
    port = free_port()
    worker = subprocess.Popen([sys.executable, "-m", "gridserve.cli", "worker", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        address = f"127.0.0.1:{port}"
        with make_channel(address) as channel:
            while health_status(channel) == "UNREACHABLE":
                if worker.poll() is not None:
                    raise RuntimeError("the worker process exited")
                time.sleep(0.1)
        yield address
    finally:
        worker.terminate()
        worker.wait(timeout=30)


def _run_engine(executor: str, model: str, prompts: list[list[int]], args: argparse.Namespace,
                workers: Optional[list[str]] = None) -> ExecutorResult:
    from gridserve.llm_engine import in_process_executor
    from gridserve.services.engine.core import EngineCore
    from gridserve.services.engine.request import Request
    from gridserve.shared.config import GridserveConfig
    from gridserve.shared.sampling_params import SamplingParams
    from gridserve.shared.scheduler_output import SchedulerOutput

    config = GridserveConfig.from_kwargs(
        model=model, kv_cache_memory_bytes=args.kv_cache_memory_bytes, distributed_executor_backend=executor,
        worker_addresses=workers or [],
    ).finalize()
    core = EngineCore(config, in_process_executor(config))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)

        def drive(batch: list[list[int]], tag: str) -> tuple[int, list[float]]:
            for i, ids in enumerate(batch):
                core.add_request(Request(f"{tag}{i}", ids, params))
            tokens, step_times = 0, []
            while core.has_unfinished_requests():
                t0 = time.perf_counter()
                tokens += sum(len(o.new_token_ids) for o in core.step())
                step_times.append(time.perf_counter() - t0)
            return tokens, step_times

        # Like the engine service, the busy loop runs in its own thread (for both executors: torch
        # in the main thread with 2 OpenMP threads is many times slower on a loaded machine).
        with ThreadPoolExecutor(1, thread_name_prefix="engine-loop") as loop:
            loop.submit(drive, [p[:16] for p in prompts[:4]], "warm").result()
            t0 = time.perf_counter()
            tokens, step_times = loop.submit(drive, prompts, "r").result()
            elapsed = time.perf_counter() - t0
        rtt = _median_ms(lambda: core.executor.check_health())
        empty = _median_ms(lambda: core.executor.execute_model(SchedulerOutput()))
    finally:
        core.shutdown()
    logger.info("%s: %d tokens in %.2f s", executor, tokens, elapsed)
    return ExecutorResult(executor, tokens, elapsed, len(step_times),
                          statistics.median(step_times) * 1e3, rtt, empty)


def _median_ms(fn, repeat: int = 200) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3
