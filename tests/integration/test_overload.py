"""Overload through the real Envoy edge (issue 18): admission control, deadlines, truthful health.

One deployment with a serial engine (``--max-num-seqs 1``) and ``--max-waiting-requests 4``, so
the queue fills with a few requests: the excess of a burst gets HTTP 429 with ``Retry-After`` (gRPC
RESOURCE_EXHAUSTED) and the admitted ones all complete; a 1 s gRPC deadline or the gateway's
``--request-timeout`` ends a long generation (DEADLINE_EXCEEDED / HTTP 504) and frees its blocks; a
sleeping engine is not ready but live, and the router sends it nothing. A second deployment, with
the test-only fault injection on, shows a stopped loop thread making the engine not live.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import time
import urllib.error
import urllib.request

import grpc
import pytest

from gridserve.api.engine.v1 import engine_pb2
from gridserve.launcher import free_port
from gridserve.shared.rpc.client import health_status

from .services import address, deployment, engine_stub, gateway_stub, greedy, pid, token_prompt

pytestmark = pytest.mark.slow

ENGINE_ARGS = ["--kv-cache-memory-bytes", str(32 << 20), "--max-num-seqs", "1", "--max-waiting-requests", "4"]
REQUEST_TIMEOUT_S = 3.0
LONG = 480  # tokens: n=4 of these on a serial engine take far longer than any deadline below


@pytest.fixture(scope="module")
def edge(llama_tiny, tmp_path_factory):
    with deployment(llama_tiny, tmp_path_factory.mktemp("logs"), edge_port=free_port(), engine_args=ENGINE_ARGS,
                    gateway_args=["--request-timeout", str(REQUEST_TIMEOUT_S)]) as launcher:
        yield launcher


def _post(launcher, path: str, body: dict, timeout: float = 60) -> tuple[int, dict, dict]:
    request = urllib.request.Request(f"http://{launcher.edge_address}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, dict(response.headers), json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


def _completion(max_tokens: int, n: int = 1) -> dict:
    return {"prompt": "def main():", "max_tokens": max_tokens, "min_tokens": max_tokens, "n": n,
            "temperature": 0}


def _load(launcher) -> engine_pb2.GetLoadResponse:
    with grpc.insecure_channel(address(launcher, "engine")) as channel:
        return engine_stub(channel).GetLoad(engine_pb2.GetLoadRequest(), timeout=10)


def _until(predicate, timeout: float = 20.0, what: str = ""):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def _assert_idle(launcher) -> None:
    """Nothing running or waiting, every KV block free (the engine's own numbers)."""
    load = _until(lambda: (lo := _load(launcher)).num_running == 0 and lo.num_waiting == 0 and lo,
                  what="an idle engine")
    assert load.kv_cache_usage == 0.0 and load.kv_free_blocks == load.kv_total_blocks, load


def _assert_openai_error(body: dict, code: int) -> None:
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["code"] == code, body


# ---- admission control ------------------------------------------------------------------------
def test_a_burst_of_40_gets_429_with_retry_after_beyond_the_queue_and_the_admitted_complete(edge):
    with concurrent.futures.ThreadPoolExecutor(40) as pool:
        results = list(pool.map(lambda _: _post(edge, "/v1/completions", _completion(4)), range(40)))
    statuses = [status for status, _, _ in results]
    assert set(statuses) <= {200, 429}, statuses
    refused = [(headers, body) for status, headers, body in results if status == 429]
    served = [body for status, _, body in results if status == 200]
    assert len(refused) >= 20 and len(served) >= 5, statuses  # at most 1 running + 4 waiting at a time
    for headers, body in refused:
        assert int(headers["retry-after"]) >= 1, headers
        _assert_openai_error(body, 429)
        assert body["error"]["type"] == "RateLimitError"
    for body in served:
        assert body["usage"]["completion_tokens"] == 4 and body["choices"][0]["finish_reason"] == "length"
    _assert_idle(edge)


def test_a_full_queue_refuses_native_grpc_and_rest_alike_then_admits_again(edge):
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        # One running and four waiting: the engine's queue is full for as long as they run.
        holders = [pool.submit(_post, edge, "/v1/completions", _completion(LONG)) for _ in range(5)]
        _until(lambda: _load(edge).num_waiting == 4, what="a full queue")
        with grpc.insecure_channel(edge.edge_address) as channel:
            with pytest.raises(grpc.RpcError) as err:
                list(gateway_stub(channel).Generate(token_prompt([5, 17, 300], greedy(2)), timeout=10))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
        assert ("retry-after", "1") in tuple(err.value.trailing_metadata() or ()), err.value.trailing_metadata()
        status, headers, body = _post(edge, "/v1/completions", _completion(2))
        assert status == 429 and headers["retry-after"] == "1", (status, headers, body)
        outcomes = [h.result()[0] for h in holders]
    # Each holder either finished or hit the gateway's --request-timeout; none was refused.
    assert set(outcomes) <= {200, 504}, outcomes
    _assert_idle(edge)
    assert _post(edge, "/v1/completions", _completion(2))[0] == 200


# ---- the edge ---------------------------------------------------------------------------------
def test_a_64_mb_body_gets_413_in_openai_shape_not_a_reset(edge):
    """Before: the connection was reset. The edge answers 413 as soon as it sees the length; a client
    still sending may get a reset on write, but the answer is there to read (curl shows it)."""
    body = json.dumps({"prompt": "x" * (64 << 20), "max_tokens": 1}).encode()
    host, port = edge.edge_address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: edge\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body))
        try:
            sock.sendall(body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before the whole body was read
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), answer[:300]
    _assert_openai_error(json.loads(payload), 413)


def test_envoy_starts_without_the_unlimited_connections_warning(edge):
    log = (edge.log_dir / "edge-0.log").read_text()
    assert "no configured limit to the number of allowed active downstream connections" not in log, log[-2000:]


# ---- deadlines --------------------------------------------------------------------------------
def test_a_1s_grpc_deadline_ends_a_long_generation_and_frees_its_blocks(edge):
    start = time.monotonic()
    with grpc.insecure_channel(edge.edge_address) as channel:
        with pytest.raises(grpc.RpcError) as err:
            list(gateway_stub(channel).Generate(token_prompt([5, 17, 300], greedy(LONG, n=4)), timeout=1.0))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.value
    assert time.monotonic() - start < 3.0
    _assert_idle(edge)  # the gateway aborted the engine requests


def test_the_request_timeout_ends_a_long_rest_generation_with_504_in_openai_shape(edge):
    start = time.monotonic()
    status, _, body = _post(edge, "/v1/completions", _completion(LONG, n=4))
    elapsed = time.monotonic() - start
    assert status == 504, body
    _assert_openai_error(body, 504)
    assert "deadline" in body["error"]["message"] and REQUEST_TIMEOUT_S - 0.5 < elapsed < REQUEST_TIMEOUT_S + 3
    _assert_idle(edge)


def test_the_request_timeout_ends_a_stream_in_band(edge):
    request = urllib.request.Request(
        f"http://{edge.edge_address}/v1/completions", data=json.dumps({**_completion(LONG, n=4), "stream": True}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        events = [line for line in response.read().decode().split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == 504 and "deadline" in error["message"], error
    _assert_idle(edge)


# ---- health -----------------------------------------------------------------------------------
def _engine_health(launcher, service: str) -> str:
    with grpc.insecure_channel(address(launcher, "engine")) as channel:
        return health_status(channel, service)


def _engine_state_gauge(launcher) -> dict[str, float]:
    with grpc.insecure_channel(address(launcher, "engine")) as channel:
        port = engine_stub(channel).GetInfo(engine_pb2.GetInfoRequest(), timeout=10).metrics_port
    host = address(launcher, "engine").rpartition(":")[0]
    text = urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10).read().decode()
    return {line.split('state="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("gridserve:engine_state{")}


def test_a_sleeping_engine_is_not_ready_but_live_and_gets_no_request(edge):
    with grpc.insecure_channel(address(edge, "engine")) as channel:
        engine_stub(channel).Sleep(engine_pb2.SleepRequest(level=1), timeout=30)
    try:
        assert _engine_health(edge, "") == "NOT_SERVING"
        assert _engine_health(edge, "liveness") == "SERVING"
        assert _load(edge).state == "sleeping" and _load(edge).sleeping
        gauge = _engine_state_gauge(edge)
        assert gauge["sleeping"] == 1.0 and sum(gauge.values()) == 1.0, gauge
        # The gateway's router sees it not ready (health Watch): no engine for a new request.
        status, _, body = _until(lambda: (r := _post(edge, "/v1/completions", _completion(2)))[0] == 503 and r,
                                 what="the gateway to see the engine asleep")
        _assert_openai_error(body, 503)
    finally:
        with grpc.insecure_channel(address(edge, "engine")) as channel:
            engine_stub(channel).WakeUp(engine_pb2.WakeUpRequest(), timeout=30)
    assert _engine_health(edge, "") == "SERVING" and _load(edge).state == "ready"
    assert _engine_state_gauge(edge)["ready"] == 1.0
    _until(lambda: _post(edge, "/v1/completions", _completion(2))[0] == 200, what="serving again")


@pytest.fixture()
def faulty_engine(llama_tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("GRIDSERVE_TEST_HOOKS", "1")
    monkeypatch.setenv("GRIDSERVE_TEST_ENGINE_SIGUSR1_STOP", "1")  # the engine stops its loop thread on SIGUSR1
    monkeypatch.setenv("GRIDSERVE_LOOP_WATCHDOG_S", "2")
    with deployment(llama_tiny, tmp_path) as launcher:
        yield launcher


def test_a_stopped_loop_thread_makes_the_engine_not_live(faulty_engine):
    assert _engine_health(faulty_engine, "liveness") == "SERVING"
    os.kill(pid(faulty_engine, "engine"), signal.SIGUSR1)
    _until(lambda: _engine_health(faulty_engine, "liveness") == "NOT_SERVING", timeout=10,
           what="liveness to notice the stopped loop")
    assert _engine_health(faulty_engine, "liveness") == "NOT_SERVING"
