"""The edge's limits (``EdgeLimits``): body size, downstream connections, idle streams; and the
limits on slow and greedy clients (body deadline, idle connections, requests per connection, per
client, the heap) and CORS preflights, each on the real Envoy binary.

One deployment with small limits, so each is reached with a few requests; the limits that Envoy
enforces before any gateway is involved are checked on an Envoy alone (its gateways unreachable),
started per test with only that limit small.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Optional

import grpc
import pytest

from gridserve.api.gateway.v1 import gateway_pb2
from gridserve.edge import CLUSTER, CorsPolicy, EdgeLimits, envoy_argv, envoy_config, write_config
from gridserve.launcher import free_port

from .services import deployment, gateway_stub

pytestmark = pytest.mark.slow

LIMITS = EdgeLimits(max_request_body_bytes=64 << 10, max_connections=8, stream_idle_timeout_s=30,
                    max_requests_per_connection=5)


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


def test_clients_that_outlive_a_connection_carry_on_over_a_new_one(edge):
    """Past max_requests_per_connection an HTTP/1.1 keep-alive client reconnects and a gRPC
    channel follows Envoy's GOAWAY: no request of either is lost."""
    host, port = edge.edge_address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    closes = 0
    for _ in range(3 * LIMITS.max_requests_per_connection):
        conn.request("GET", "/v1/models")
        resp = conn.getresponse()
        resp.read()
        assert resp.status == 200
        closes += resp.getheader("connection") == "close"
    conn.close()
    assert closes == 3  # every 5th answer closed its connection
    with grpc.insecure_channel(edge.edge_address) as channel:
        stub = gateway_stub(channel)
        for _ in range(3 * LIMITS.max_requests_per_connection):
            assert stub.ListModels(gateway_pb2.ListModelsRequest(), timeout=30).models


def test_the_config_bounds_every_stream_without_a_total_timeout():
    config = envoy_config("127.0.0.1", 8000, ["127.0.0.1:1", "127.0.0.1:2"], limits=LIMITS)
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert manager["stream_idle_timeout"] == "30s"
    routes = manager["route_config"]["virtual_hosts"][0]["routes"]
    route = next(r["route"] for r in routes if r.get("route", {}).get("cluster") == CLUSTER)
    assert route["timeout"] == "0s"  # a long generation is never cut while it streams
    (threshold,) = config["static_resources"]["clusters"][0]["circuit_breakers"]["thresholds"]
    assert threshold["max_requests"] == 2 * LIMITS.max_requests_per_gateway


@pytest.mark.parametrize("field", ["max_request_body_bytes", "max_connections", "stream_idle_timeout_s",
                                   "request_body_timeout_s", "connection_idle_timeout_s",
                                   "max_requests_per_connection", "max_requests_per_client_per_s", "max_heap_bytes"])
def test_nonpositive_limits_are_refused_naming_the_field(field):
    with pytest.raises(ValueError, match=field):
        EdgeLimits(**{field: 0})


@contextlib.contextmanager
def lone_edge(tmp_path, limits: Optional[EdgeLimits] = None, cors: Optional[CorsPolicy] = None) -> Iterator[int]:
    """The edge's Envoy alone on a free loopback port (its one gateway address has no listener):
    Envoy answers itself, with its limits, its 404 for unknown paths and its 503 for the rest."""
    port = free_port()
    config = write_config(tmp_path / "edge.json", envoy_config("127.0.0.1", port, [f"127.0.0.1:{free_port()}"],
                                                               limits=limits or EdgeLimits(),
                                                               cors=cors or CorsPolicy()))
    with open(tmp_path / "edge.log", "wb") as log:
        process = subprocess.Popen(envoy_argv(config), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError((tmp_path / "edge.log").read_text()) from None
                time.sleep(0.05)
        yield port
    finally:
        process.terminate()
        process.wait(timeout=30)


def _until_closed(sock: socket.socket, timeout_s: float) -> tuple[bytes, float]:
    """Everything the edge sends until it closes the connection, and how long that took."""
    sock.settimeout(timeout_s)
    start, data = time.monotonic(), b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            data += chunk
    return data, time.monotonic() - start


def test_a_request_whose_body_never_arrives_gets_408_after_the_body_deadline(tmp_path):
    limits = EdgeLimits(request_headers_timeout_s=1, request_body_timeout_s=2)
    with lone_edge(tmp_path, limits) as port, socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: edge\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"prompt\": ")  # then nothing
        answer, waited = _until_closed(sock, timeout_s=30)
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["message"] == "request timeout"
    assert 1.5 <= waited < 15  # the body deadline, not the headers timeout or forever


def test_a_request_whose_headers_never_end_gets_408_after_the_headers_timeout(tmp_path):
    with lone_edge(tmp_path, EdgeLimits(request_headers_timeout_s=1)) as port, \
            socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: edge\r\nX-Slow: a")
        answer, waited = _until_closed(sock, timeout_s=30)
    assert answer.startswith(b"HTTP/1.1 408") and b"request header timeout" in answer, answer
    assert waited < 15


def test_a_connection_that_never_sends_a_byte_is_closed_after_the_idle_timeout(tmp_path):
    # The headers timeout starts with the first byte: a silent connection is the idle timeout's.
    with lone_edge(tmp_path, EdgeLimits(connection_idle_timeout_s=1)) as port, \
            socket.create_connection(("127.0.0.1", port)) as sock:
        answer, waited = _until_closed(sock, timeout_s=30)
    assert answer == b"" and waited < 15


def test_the_last_request_a_connection_may_carry_closes_it(tmp_path):
    with lone_edge(tmp_path, EdgeLimits(max_requests_per_connection=3)) as port:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        answers = []
        for _ in range(3):
            conn.request("GET", "/no-such-path")
            resp = conn.getresponse()
            resp.read()
            answers.append((resp.status, resp.getheader("connection")))
        assert answers == [(404, None), (404, None), (404, "close")]
        assert conn.sock is None  # http.client saw "connection: close" and dropped the socket
        conn.request("GET", "/no-such-path")  # the 4th request: a new connection, served
        assert conn.getresponse().status == 404
        conn.close()


def test_one_client_past_its_request_rate_gets_429_in_openai_shape_on_any_connection(tmp_path):
    with lone_edge(tmp_path, EdgeLimits(max_requests_per_client_per_s=5)) as port:
        statuses, body = [], b""
        for _ in range(20):  # a new connection each: the bucket is the client's, not the connection's
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("GET", "/no-such-path")
            resp = conn.getresponse()
            body = resp.read()
            statuses.append(resp.status)
            conn.close()
    assert statuses[:5] == [404] * 5 and 429 in statuses, statuses  # 5 a second, 20 sent in far less
    assert json.loads(body)["error"]["type"] == "RateLimitError"


def test_an_edge_past_its_heap_limit_refuses_new_requests_with_503(tmp_path):
    # 1 MiB is less than Envoy needs to run: the overload manager trips at its first look.
    with lone_edge(tmp_path, EdgeLimits(max_heap_bytes=1 << 20)) as port:
        deadline, status, body = time.monotonic() + 20, None, b""
        while time.monotonic() < deadline and status != 503:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("GET", "/no-such-path")
            resp = conn.getresponse()
            status, body = resp.status, resp.read()
            conn.close()
            time.sleep(0.1)
    assert status == 503 and b"envoy overloaded" in body, (status, body)


def _preflight(port: int, origin: str) -> tuple[int, dict[str, str]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("OPTIONS", "/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    resp = conn.getresponse()
    resp.read()
    conn.close()
    return resp.status, {k.lower(): v for k, v in resp.getheaders() if k.lower().startswith("access-control-")}


def test_envoy_answers_preflights_with_cors_headers_only_for_allowed_origins(tmp_path):
    policy = CorsPolicy(("http://app.example:8080",), ("GET", "POST"), ("*",))
    with lone_edge(tmp_path, cors=policy) as port:
        allowed = _preflight(port, "http://app.example:8080")
        other = _preflight(port, "http://evil.example")
    assert allowed[0] == 200 and allowed[1]["access-control-allow-origin"] == "http://app.example:8080"
    assert allowed[1]["access-control-allow-methods"] == "GET,POST"
    assert "authorization" in allowed[1]["access-control-allow-headers"]  # '*' echoes what is asked
    assert other[0] == 200 and "access-control-allow-origin" not in other[1]  # answered, not allowed


def test_without_allowed_origins_the_edge_sends_no_cors_headers(tmp_path):
    with lone_edge(tmp_path) as port:
        status, headers = _preflight(port, "http://app.example:8080")
    assert status == 404 and headers == {}
