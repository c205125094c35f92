"""The edge in front of two gateway replicas with ``--api-key``: authentication on every path,
200 concurrent streaming clients, and a replica killed mid-run.

One deployment for the module (worker, engine, 2 gateways, real Envoy with its admin port on
loopback); the test that kills a replica runs last.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from gridserve.api.gateway.v1 import gateway_pb2
from gridserve.launcher import free_port

from .services import deployment, gateway_stub, greedy, token_prompt

pytestmark = pytest.mark.slow

API_KEY = "test-key-123"
CLIENTS = 200


@pytest.fixture(scope="module")
def edge(llama_tiny, tmp_path_factory):
    with deployment(llama_tiny, tmp_path_factory.mktemp("logs"), edge_port=free_port(), api_server_count=2,
                    api_key=API_KEY, edge_admin_port=free_port()) as launcher:
        yield launcher


def _request(url: str, body=None, key=None) -> tuple[int, str]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=60) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _rq_total_per_gateway(launcher) -> dict[str, int]:
    """Requests Envoy sent to each replica (admin ``/clusters``: ``gateways::host:port::rq_total::N``)."""
    url = f"http://127.0.0.1:{launcher.edge_admin_port}/clusters"
    with urllib.request.urlopen(url, timeout=10) as resp:
        lines = resp.read().decode().splitlines()
    totals = {}
    for line in lines:
        parts = line.split("::")
        if len(parts) == 4 and parts[0] == "gateways" and parts[2] == "rq_total":
            totals[parts[1]] = int(parts[3])
    return totals


def test_api_key_is_required_on_v1_routes(edge):
    base = f"http://{edge.edge_address}"
    body = {"prompt": "x", "max_tokens": 2}
    for key in (None, "wrong"):
        status, text = _request(f"{base}/v1/completions", body, key)
        assert status == 401, text
        error = json.loads(text)["error"]
        assert error["code"] == 401 and error["type"] == "AuthenticationError" and "API key" in error["message"]
    assert _request(f"{base}/v1/models", key=None)[0] == 401
    status, text = _request(f"{base}/v1/completions", body, API_KEY)
    assert status == 200 and json.loads(text)["object"] == "text_completion"
    # As with vllm serve --api-key: the routes outside /v1 stay open.
    assert _request(f"{base}/health")[0] == 200
    assert _request(f"{base}/version")[0] == 200
    assert _request(f"{base}/tokenize", {"prompt": "hi"})[0] == 200


def test_openai_client_with_the_key(edge):
    openai = pytest.importorskip("openai")
    good = openai.OpenAI(base_url=f"http://{edge.edge_address}/v1", api_key=API_KEY, max_retries=0)
    assert len(good.models.list().data) == 1
    bad = openai.OpenAI(base_url=f"http://{edge.edge_address}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        bad.completions.create(model=good.models.list().data[0].id, prompt="x", max_tokens=2)
    assert err.value.status_code == 401


def test_native_grpc_needs_the_key_in_metadata(edge):
    with grpc.insecure_channel(edge.edge_address) as channel:
        stub = gateway_stub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(token_prompt([5, 6, 7], greedy(2)), timeout=10))
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        metadata = (("authorization", f"Bearer {API_KEY}"),)
        ids = [t for r in stub.Generate(token_prompt([5, 6, 7], greedy(2)), timeout=30, metadata=metadata)
               for t in r.token_ids]
        assert len(ids) == 2
    # Health checks (Kubernetes probes, Envoy) need no key.
    from gridserve.shared.rpc.client import health_status, make_channel

    with make_channel(edge.gateway_addresses[0]) as channel:
        assert health_status(channel) == "SERVING"


def _stream_one(address: str, i: int, max_tokens: int) -> tuple[str, int]:
    """One streaming completion: ("ok", chunks) when it ends with [DONE], else ("error: ...", chunks)."""
    host, port = address.rsplit(":", 1)
    body = {"prompt": [5 + i % 50, 17, 300, 42], "max_tokens": max_tokens, "min_tokens": max_tokens,
            "temperature": 0, "stream": True}
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}
    chunks = 0
    conn = http.client.HTTPConnection(host, int(port), timeout=120)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), headers)
        resp = conn.getresponse()
        if resp.status != 200:
            return f"error: HTTP {resp.status}: {resp.read()[:300]!r}", 0
        for raw in resp:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                return "ok", chunks
            if line.startswith("data: "):
                if '"error"' in line:
                    return f"error: {line}", chunks
                chunks += 1
        return "error: ended without [DONE]", chunks
    except Exception as exc:  # noqa: BLE001 - a failed client is counted, not raised
        return f"error: {type(exc).__name__}: {exc}", chunks
    finally:
        conn.close()


def _run_clients(edge, count: int, max_tokens: int, start_index: int = 0) -> list[tuple[str, int]]:
    """``count`` clients at once, each on its own connection and thread."""
    with ThreadPoolExecutor(max_workers=count) as pool:
        futures = [pool.submit(_stream_one, edge.edge_address, start_index + i, max_tokens) for i in range(count)]
        return [f.result(timeout=240) for f in futures]


def test_200_concurrent_streaming_clients_all_complete_on_both_replicas(edge):
    before = _rq_total_per_gateway(edge)
    results = _run_clients(edge, CLIENTS, max_tokens=8)
    failures = [r for r in results if r[0] != "ok"]
    assert not failures, failures[:5]
    assert all(chunks == 8 for _, chunks in results)
    after = _rq_total_per_gateway(edge)
    served = {g: after[g] - before.get(g, 0) for g in after}
    assert sorted(served) == sorted(edge.gateway_addresses)
    assert all(n >= CLIENTS // 4 for n in served.values()), served  # round robin: both replicas did work


def test_killing_a_replica_mid_run_loses_no_new_request(edge):
    """SIGKILL one gateway while streams run; every request sent after the kill still completes
    (Envoy retries refused connections on the other replica and ejects the dead one)."""

    with ThreadPoolExecutor(max_workers=1) as background:
        first = background.submit(_run_clients, edge, 60, 48)
        time.sleep(1.0)
        victim = next(p for p in edge.processes if p.role == "gateway" and p.address == edge.gateway_addresses[1])
        os.kill(victim.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        after_kill = _run_clients(edge, 100, max_tokens=4, start_index=1000)
        in_flight = first.result(timeout=240)
    elapsed = time.monotonic() - killed_at
    failures = [r for r in after_kill if r[0] != "ok"]
    assert not failures, failures[:5]
    # Streams on the killed replica end (cut off, not hung); those on the other one complete.
    assert sum(r[0] == "ok" for r in in_flight) >= len(in_flight) // 4
    assert elapsed < 120


def test_503_openai_shaped_once_no_engine_is_ready(edge):
    """Runs last: kills the engine. The gateways report NOT_SERVING, Envoy's health checks take
    them out, and the edge answers 503 in OpenAI's error shape (Envoy's local reply)."""
    engine = next(p for p in edge.processes if p.role == "engine")
    os.kill(engine.pid, signal.SIGKILL)
    base = f"http://{edge.edge_address}"
    deadline = time.monotonic() + 15
    while (status := _request(f"{base}/health")[0]) != 503:
        assert time.monotonic() < deadline, status
        time.sleep(0.2)
    for path, body in (("/health", None), ("/v1/completions", {"prompt": "x", "max_tokens": 2})):
        status, text = _request(f"{base}{path}", body, API_KEY)
        assert status == 503, text
        error = json.loads(text)["error"]
        assert error["code"] == 503 and error["type"] == "ServiceUnavailableError" and error["message"]
