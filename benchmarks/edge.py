"""``gridserve bench edge``: what the Envoy edge adds to time to first token.

Starts one local deployment (worker, engine, gateway, Envoy) and sends the same short streaming
request, one at a time, three ways in turn (so drift on a shared machine hits all three alike):
OpenAI REST through Envoy (``POST /v1/completions``, first ``data:`` event), native gRPC through
Envoy, and native gRPC straight to the gateway (first ``GenerateResponse``). Reports the median
and p90 TTFT of each and the median of the per-round differences to the direct path.

With ``--tls`` it starts a second deployment with ``gridserve serve --tls``'s mutual TLS (HTTPS and
gRPC over TLS at the edge, mTLS on every internal link) and interleaves the same requests on both;
it reports what TLS adds: the median of the per-round differences, TLS minus plaintext, per path.
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
    parser.add_argument("--tls", action="store_true",
                        help="also a mutual-TLS deployment (serve --tls), interleaved: what TLS adds to TTFT")


def _rest_ttft(address: str, max_tokens: int, ssl_context=None) -> float:
    """A new connection per request (HTTPS: its handshake included), as a simple client does."""
    host, port = address.rsplit(":", 1)
    if ssl_context is not None:
        conn = http.client.HTTPSConnection(host, int(port), timeout=60, context=ssl_context)
    else:
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


def _paths(launcher, suffix: str, max_tokens: int, stack) -> dict[str, Callable[[], float]]:
    """The three paths of one deployment (``suffix`` on their names); with TLS, the client trusts the
    throwaway CA at the edge and presents the admin certificate to the gateway."""
    import ssl

    import grpc

    from gridserve.api.gateway.v1 import gateway_pb2_grpc
    from gridserve.shared.rpc.client import make_channel

    context = None
    if launcher.edge_ca_file:
        context = ssl.create_default_context(cafile=launcher.edge_ca_file)
        with open(launcher.edge_ca_file, "rb") as f:
            credentials = grpc.ssl_channel_credentials(root_certificates=f.read())
        via_edge = stack.enter_context(grpc.secure_channel(launcher.edge_address, credentials))
    else:
        via_edge = stack.enter_context(make_channel(launcher.edge_address))
    direct = stack.enter_context(make_channel(launcher.gateway_addresses[0], launcher.admin_tls))
    return {
        "rest_via_envoy" + suffix: lambda: _rest_ttft(launcher.edge_address, max_tokens, context),
        "grpc_via_envoy" + suffix: lambda: _grpc_ttft(gateway_pb2_grpc.GatewayStub(via_edge), max_tokens),
        "grpc_direct" + suffix: lambda: _grpc_ttft(gateway_pb2_grpc.GatewayStub(direct), max_tokens),
    }


def run(args: argparse.Namespace) -> int:
    import contextlib
    import tempfile

    from gridserve.launcher import Launcher, free_port

    model = args.model
    if model is None:
        from gridserve.demo.recipe import ensure_checkpoint

        model = str(ensure_checkpoint("llama", "tiny"))
    with tempfile.TemporaryDirectory(prefix="gridserve-bench-edge-") as logs, contextlib.ExitStack() as stack:
        launchers = {"": Launcher(model, ["--kv-cache-memory-bytes", str(64 << 20)], edge_port=free_port(),
                                  log_dir=Path(logs) / "plain")}
        if getattr(args, "tls", False):
            launchers["_tls"] = Launcher(model, ["--kv-cache-memory-bytes", str(64 << 20)], edge_port=free_port(),
                                         log_dir=Path(logs) / "tls", tls=True)
        paths: dict[str, Callable[[], float]] = {}
        for suffix, launcher in launchers.items():
            stack.callback(launcher.stop)
            # A port picked when the launchers were built may since have gone to a role of the
            # first deployment (roles bind ephemeral ports): pick the edge's just before it starts.
            launcher.edge_port = free_port()
            launcher.start()
            paths.update(_paths(launcher, suffix, args.max_tokens, stack))
        for measure in paths.values():  # warm-up: connections, first-step allocations
            for _ in range(3):
                measure()
        samples: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(args.requests):
            for name, measure in paths.items():
                samples[name].append(measure())
    results = {name: _summary(values) for name, values in samples.items()}
    # Each round measures the three paths back to back: the median of the per-round differences
    # cancels the drift of a shared machine better than the difference of the medians.
    direct = samples["grpc_direct"]
    results["added_median_ms"] = {
        name: statistics.median(a - b for a, b in zip(samples[name], direct)) * 1e3
        for name in ("rest_via_envoy", "grpc_via_envoy")
    }
    if getattr(args, "tls", False):  # TLS minus plaintext, round by round
        results["tls_added_median_ms"] = {
            name: statistics.median(a - b for a, b in zip(samples[name + "_tls"], samples[name])) * 1e3
            for name in ("rest_via_envoy", "grpc_via_envoy", "grpc_direct")
        }
    print(f"{'path':<20}{'median TTFT ms':>16}{'p90 ms':>10}")
    for name in paths:
        print(f"{name:<20}{results[name]['median_ms']:>16.2f}{results[name]['p90_ms']:>10.2f}")
    for name, added in results["added_median_ms"].items():
        print(f"edge adds {added:+.2f} ms (median of paired differences) for {name}")
    for name, added in results.get("tls_added_median_ms", {}).items():
        print(f"TLS adds {added:+.2f} ms (median of paired differences) for {name}")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps({"model": model, "max_tokens": args.max_tokens,
                                                      **results}, indent=2))
    return 0
