"""``gridserve bench edge``: what the Envoy edge adds to time to first token.

Starts one local deployment (worker, engine, gateway, Envoy) and sends the same short streaming
request, one at a time, three ways in turn (so drift on a shared machine hits all three alike):
OpenAI REST through Envoy (``POST /v1/completions``, first ``data:`` event), native gRPC through
Envoy, and native gRPC straight to the gateway (first ``GenerateResponse``). Reports the median
and p90 TTFT of each and the median of the per-round differences to the direct path.
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

PROMPT = [5, 17, 300, 42, 901, 7, 64, 12]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF folder (default: the recipe's llama tiny)")
    parser.add_argument("--requests", type=int, default=100, help="requests per path")
    parser.add_argument("--max-tokens", type=int, default=2, help="tokens per request")
    parser.add_argument("--output-json", default=None, help="write the results here")


def _rest_ttft(address: str, max_tokens: int) -> float:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = json.dumps({"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True})
    try:
        start = time.perf_counter()
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        first = None
        for raw in resp:
            if first is None and raw.startswith(b"data: {"):
                first = time.perf_counter() - start
        if resp.status != 200 or first is None:
            raise RuntimeError(f"REST request failed: HTTP {resp.status}")
        return first
    finally:
        conn.close()


def _grpc_ttft(stub, max_tokens: int) -> float:
    from gridserve.api.common.v1 import common_pb2
    from gridserve.api.gateway.v1 import gateway_pb2

    request = gateway_pb2.GenerateRequest(
        token_ids=gateway_pb2.TokenIds(ids=PROMPT),
        sampling_params=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens))
    start = time.perf_counter()
    first = None
    for _ in stub.Generate(request, timeout=60):
        if first is None:
            first = time.perf_counter() - start
    return first


def _summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"median_ms": statistics.median(ordered) * 1e3,
            "p90_ms": ordered[int(0.9 * (len(ordered) - 1))] * 1e3, "n": len(ordered)}


def run(args: argparse.Namespace) -> int:
    import tempfile

    from gridserve.api.gateway.v1 import gateway_pb2_grpc
    from gridserve.launcher import Launcher, free_port
    from gridserve.shared.rpc.client import make_channel

    model = args.model
    if model is None:
        from gridserve.demo.recipe import ensure_checkpoint

        model = str(ensure_checkpoint("llama", "tiny"))
    with tempfile.TemporaryDirectory(prefix="gridserve-bench-edge-") as logs:
        launcher = Launcher(model, ["--kv-cache-memory-bytes", str(64 << 20)], edge_port=free_port(),
                            log_dir=Path(logs))
        try:
            launcher.start()
            with make_channel(launcher.edge_address) as via_edge, \
                    make_channel(launcher.gateway_addresses[0]) as direct:
                paths: dict[str, Callable[[], float]] = {
                    "rest_via_envoy": lambda: _rest_ttft(launcher.edge_address, args.max_tokens),
                    "grpc_via_envoy": lambda: _grpc_ttft(gateway_pb2_grpc.GatewayStub(via_edge), args.max_tokens),
                    "grpc_direct": lambda: _grpc_ttft(gateway_pb2_grpc.GatewayStub(direct), args.max_tokens),
                }
                for measure in paths.values():  # warm-up: connections, first-step allocations
                    for _ in range(3):
                        measure()
                samples: dict[str, list[float]] = {name: [] for name in paths}
                for _ in range(args.requests):
                    for name, measure in paths.items():
                        samples[name].append(measure())
        finally:
            launcher.stop()
    results = {name: _summary(values) for name, values in samples.items()}
    # Each round measures the three paths back to back: the median of the per-round differences
    # cancels the drift of a shared machine better than the difference of the medians.
    direct = samples["grpc_direct"]
    results["added_median_ms"] = {
        name: statistics.median(a - b for a, b in zip(samples[name], direct)) * 1e3
        for name in ("rest_via_envoy", "grpc_via_envoy")
    }
    print(f"{'path':<16}{'median TTFT ms':>16}{'p90 ms':>10}")
    for name in paths:
        print(f"{name:<16}{results[name]['median_ms']:>16.2f}{results[name]['p90_ms']:>10.2f}")
    for name, added in results["added_median_ms"].items():
        print(f"edge adds {added:+.2f} ms (median of paired differences) for {name}")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({"model": model, "max_tokens": args.max_tokens,
                                                      **results}, indent=2))
    return 0
