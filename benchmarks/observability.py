"""``gridserve bench observability``: what metrics and tracing cost the engine per step.

The engine's busy loop runs the same workload (``--batch`` concurrent requests, ``--input-len``
prompt tokens, ``--output-len`` generated tokens each) against an instant in-process fake worker,
so the figure is the engine's own Python work per step (schedule, update, publish, observe), the
part observability adds to. Configurations, interleaved over ``--rounds`` rounds on one machine:

* ``bare``: ``EngineCore.step()`` alone, no step stats (the loop body before observability);
* ``off``: what a role runs without ``--metrics-port`` / ``--otlp-traces-endpoint`` (step stats
  collected, the request log line, no metrics, no tracer);
* ``metrics``: Prometheus histograms fed once per step;
* ``tracing``: a span per request (and its queue / prefill / decode children), worker step spans,
  exported over OTLP/gRPC to a dummy receiver on loopback (batch processor, 100 ms delay);
* ``metrics+tracing``.

Reported per configuration: the step's CPU time on the loop thread (robust on a loaded, shared
machine) and its wall time (which also pays for the exporter thread), each the median of the
per-round medians, and their ratios to ``bare``. Results JSON with ``--output``.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
from concurrent import futures
from concurrent.futures import Future
from typing import Any, Optional

from gridserve.shared.kv_cache_spec import FULL, KVCacheConfig, LayerKVCacheSpec

logger = logging.getLogger(__name__)

CONFIGS = ("bare", "off", "metrics", "tracing", "metrics+tracing")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=int, default=64, help="concurrent requests")
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of every configuration")
    parser.add_argument("--output", default=None, help="write the results as JSON here")


class _InstantWorker:
    """An executor whose worker answers at once: every scheduled request samples token 7."""

    max_concurrent_batches = 1

    def __init__(self, kv_bytes: int, bytes_per_token: int, observer: Any = None) -> None:
        self.kv_bytes = kv_bytes
        self.bytes_per_token = bytes_per_token
        self.observer = observer

    def get_kv_cache_spec(self) -> list[list[LayerKVCacheSpec]]:
        return [[LayerKVCacheSpec("layers", FULL, 16, self.bytes_per_token)]]

    def determine_available_memory(self) -> int:
        return self.kv_bytes

    def initialize_cache(self, kv_cache_config: KVCacheConfig) -> None:
        pass

    def execute_model(self, plan, non_block: bool = False):
        from gridserve.shared.scheduler_output import ModelRunnerOutput

        def run(p):
            ids = list(p.num_scheduled_tokens)
            return ModelRunnerOutput(req_ids=ids, sampled_token_ids=[7] * len(ids), logprobs=[None] * len(ids))

        out = self.observer.execute(run, plan, 0) if self.observer is not None else run(plan)
        future: Future = Future()
        future.set_result(out)
        return future

    def shutdown(self) -> None:
        pass


def _config(args: argparse.Namespace):
    from gridserve.shared.config import CacheConfig, GridserveConfig, ModelConfig, SchedulerConfig

    model = ModelConfig(model="bench", max_model_len=args.input_len + args.output_len + 16)
    model.num_layers, model.num_kv_heads, model.head_dim = 1, 1, 8
    tokens = args.batch * (args.input_len + 1)
    return GridserveConfig(model=model, cache=CacheConfig(block_size=16),
                           scheduler=SchedulerConfig(max_num_seqs=args.batch, max_num_batched_tokens=tokens))


def _run_once(args: argparse.Namespace, name: str, endpoint: str) -> tuple[float, float]:
    """Median step (CPU, wall) seconds of one configuration over one full workload."""
    from gridserve.services.engine.core import EngineCore
    from gridserve.services.engine.metrics import EngineMetrics
    from gridserve.services.engine.observability import EngineObserver
    from gridserve.services.engine.request import Request
    from gridserve.services.worker.observability import WorkerObserver
    from gridserve.shared.observability.tracing import Tracing
    from gridserve.shared.sampling_params import SamplingParams

    config = _config(args)
    tracing = Tracing(f"bench-{name}", endpoint) if "tracing" in name else None
    worker_observer = WorkerObserver(None, Tracing("bench-worker", endpoint)) if tracing is not None else None
    per_token = config.kv_bytes_per_token_per_rank()
    kv_bytes = 2 * args.batch * config.max_model_len * per_token
    core = EngineCore(config, executor=_InstantWorker(kv_bytes, per_token, worker_observer))
    observer: Optional[EngineObserver] = None
    if name != "bare":
        metrics = EngineMetrics(config, core.stats) if "metrics" in name else None
        observer = EngineObserver(metrics, tracing)
        core.scheduler.take_step_stats()
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    for i in range(args.batch):
        request = Request(f"r{i}", [(i * 31 + j) % 1000 + 10 for j in range(args.input_len)], params)
        if observer is not None:
            observer.on_add(request)
        core.add_request(request)
    logging.getLogger("gridserve.services.engine.observability").setLevel(logging.WARNING)
    cpu, wall = [], []
    while core.has_unfinished_requests():
        start, start_cpu = time.perf_counter(), time.thread_time()
        core.step()
        if observer is not None:
            observer.on_step(core.scheduler.take_step_stats(), time.perf_counter() - start)
        cpu.append(time.thread_time() - start_cpu)
        wall.append(time.perf_counter() - start)
    for t in (tracing, worker_observer.tracing if worker_observer else None):
        if t is not None:
            t.shutdown()
    return statistics.median(cpu), statistics.median(wall)


def _dummy_receiver():
    """An OTLP/gRPC trace endpoint on loopback that accepts and drops spans."""
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    class Drop(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Drop(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"http://127.0.0.1:{port}"


def run(args: argparse.Namespace) -> int:
    import os

    os.environ.setdefault("OTEL_BSP_SCHEDULE_DELAY", "100")
    server, endpoint = _dummy_receiver()
    per_round: dict[str, list[tuple[float, float]]] = {name: [] for name in CONFIGS}
    try:
        _run_once(args, "bare", endpoint)  # warm-up
        for _ in range(args.rounds):
            for name in CONFIGS:
                per_round[name].append(_run_once(args, name, endpoint))
    finally:
        server.stop(0)

    def med(name: str, i: int) -> float:
        return statistics.median(r[i] for r in per_round[name])

    results = {name: {"cpu_step_us": med(name, 0) * 1e6, "cpu_ratio_to_bare": med(name, 0) / med("bare", 0),
                      "wall_step_us": med(name, 1) * 1e6, "wall_ratio_to_bare": med(name, 1) / med("bare", 1),
                      "round_medians_cpu_us": [r[0] * 1e6 for r in per_round[name]],
                      "round_medians_wall_us": [r[1] * 1e6 for r in per_round[name]]}
               for name in CONFIGS}
    print(f"engine step, {args.batch} requests x {args.output_len} tokens, instant worker, "
          f"{args.rounds} interleaved rounds (median of round medians)")
    print(f"{'config':<18}{'cpu us':>9}{'vs bare':>9}{'wall us':>10}{'vs bare':>9}")
    for name, r in results.items():
        print(f"{name:<18}{r['cpu_step_us']:>9.1f}{r['cpu_ratio_to_bare']:>9.3f}"
              f"{r['wall_step_us']:>10.1f}{r['wall_ratio_to_bare']:>9.3f}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"benchmark": "observability", "batch": args.batch, "input_len": args.input_len,
                       "output_len": args.output_len, "rounds": args.rounds, "results": results}, f, indent=2)
    return 0
