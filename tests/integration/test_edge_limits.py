"""The edge's limits (``EdgeLimits``): body size, downstream connections, idle streams.

One deployment with small limits, so each is reached with a few requests.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request

import pytest

from gridserve.edge import CLUSTER, EdgeLimits, envoy_config
from gridserve.launcher import free_port

from .services import deployment

pytestmark = pytest.mark.slow

LIMITS = EdgeLimits(max_request_body_bytes=64 << 10, max_connections=8, stream_idle_timeout_s=30)


@pytest.fixture(scope="module")
def edge(llama_tiny, tmp_path_factory):
    with deployment(llama_tiny, tmp_path_factory.mktemp("logs"), edge_port=free_port(),
                    edge_limits=LIMITS) as launcher:
        yield launcher


def _post(launcher, path: str, payload: bytes) -> tuple[int, str]:
    req = urllib.request.Request(f"http://{launcher.edge_address}{path}", data=payload,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_a_body_over_the_limit_is_413_in_openai_shape(edge):
    prompt = "x " * (LIMITS.max_request_body_bytes // 2 + 10)
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 1}).encode()
    assert len(body) > LIMITS.max_request_body_bytes
    status, text = _post(edge, "/v1/completions", body)
    assert status == 413, text
    error = json.loads(text)["error"]
    assert error["code"] == "413" or error["code"] == 413


def test_a_body_under_the_limit_still_reaches_the_gateway(edge, llama_tiny):
    body = json.dumps({"model": str(llama_tiny), "prompt": "def f(", "max_tokens": 2}).encode()
    assert len(body) < LIMITS.max_request_body_bytes
    status, text = _post(edge, "/v1/completions", body)
    assert status == 200, text


def test_connections_past_the_limit_are_refused_and_the_edge_recovers(edge):
    host, port = edge.edge_address.rsplit(":", 1)
    held = [socket.create_connection((host, int(port)), timeout=5) for _ in range(LIMITS.max_connections)]
    try:
        time.sleep(0.5)  # Envoy accounts the held connections
        extra = socket.create_connection((host, int(port)), timeout=5)
        extra.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        extra.settimeout(5)
        try:
            answer = extra.recv(1024)
        except (ConnectionResetError, TimeoutError):
            answer = b""
        extra.close()
        assert not answer.startswith(b"HTTP/1.1 200"), answer
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.5)
    status, _ = _post(edge, "/v1/completions", b"{}")
    assert status in (200, 400), "the edge serves again once connections are released"


def test_the_config_bounds_every_stream_without_a_total_timeout():
    config = envoy_config("127.0.0.1", 8000, ["127.0.0.1:1", "127.0.0.1:2"], limits=LIMITS)
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert manager["stream_idle_timeout"] == "30s"
    routes = manager["route_config"]["virtual_hosts"][0]["routes"]
    route = next(r["route"] for r in routes if r.get("route", {}).get("cluster") == CLUSTER)
    assert route["timeout"] == "0s"  # a long generation is never cut while it streams
    (threshold,) = config["static_resources"]["clusters"][0]["circuit_breakers"]["thresholds"]
    assert threshold["max_requests"] == 2 * LIMITS.max_requests_per_gateway


@pytest.mark.parametrize("field", ["max_request_body_bytes", "max_connections", "stream_idle_timeout_s"])
def test_nonpositive_limits_are_refused_naming_the_field(field):
    with pytest.raises(ValueError, match=field):
        EdgeLimits(**{field: 0})
