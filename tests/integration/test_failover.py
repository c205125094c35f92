"""Faults survived with real processes: ``gridserve serve -dp 2`` of the tiny Llama as the launcher
runs it (supervised: dead roles restart), streaming completions over REST through Envoy.

- The coordinator is SIGKILLed under load and restarted: no request fails, outputs are unchanged,
  and the engines' reports and the gateway's subscription come back.
- One of two engines is SIGKILLed with 32 streams in flight: all 32 complete, each client's
  concatenated text and per-token chunks equal the fault-free run's (no duplicated or missing SSE
  chunk), usage counts are right. Prints the time to fail over (kill -> the last stalled stream's
  next token, which the other engine generated).
- With DP = 1 the engine is SIGKILLed under 8 streams: they wait for its restart and complete.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gridserve import launcher as launcher_module
from gridserve.api.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from gridserve.benchmarks.chaos import (
    Progress,
    longest_pause,
    make_requests,
    resumed_after,
    run_load,
    stream_faults,
)
from gridserve.launcher import free_port
from gridserve.shared.rpc.client import wait_until_serving

from .services import ENGINE_ARGS, deployment

pytestmark = pytest.mark.slow

STREAMS = 32
MAX_TOKENS = 120  # long enough that the engines are still generating when the test reads their gauges


@pytest.fixture(scope="module")
def served(llama_tiny, tmp_path_factory):
    saved, launcher_module.RESTART_BACKOFF_S = launcher_module.RESTART_BACKOFF_S, (0.2, 1.0)
    logs = tmp_path_factory.mktemp("logs")
    # batch-invariant (as `bench chaos`): a stream continued on the other engine recomputes its
    # tokens so far as a prefill; only then are its logits bitwise those of the fault-free decode, so
    # greedy near-ties cannot flip (without it, a continuation may differ from the fault-free run)
    engine_args = [*ENGINE_ARGS, "--batch-invariant"]
    with deployment(llama_tiny, logs, edge_port=free_port(), data_parallel_size=2,
                    engine_args=engine_args) as launcher:
        thread = threading.Thread(target=launcher.supervise, kwargs={"poll_s": 0.05}, daemon=True)
        thread.start()
        requests = make_requests(STREAMS, MAX_TOKENS)
        clean = run_load(launcher.edge_address, launcher.model, requests, STREAMS)
        yield launcher, logs, requests, clean
    thread.join(timeout=30)
    launcher_module.RESTART_BACKOFF_S = saved


def _role(launcher, role: str, group=None):
    return next(p for p in launcher.processes if p.role == role and (group is None or p.group == group))


def _load_with_kill(launcher, requests, kill_when, victim):
    """Run the load; SIGKILL ``victim`` once ``kill_when(progress)``; return results and kill time."""
    progress, out, killed = Progress(), {}, {}

    def load():
        out["results"] = run_load(launcher.edge_address, launcher.model, requests, len(requests), progress)

    thread = threading.Thread(target=load)
    thread.start()
    while not kill_when(progress):
        assert thread.is_alive(), "the load ended before the fault"
        time.sleep(0.002)
    victim = victim() if callable(victim) else victim
    killed["pid"], killed["time"] = victim.pid, time.monotonic()
    os.kill(victim.pid, signal.SIGKILL)
    thread.join(timeout=120)
    assert not thread.is_alive()
    return out["results"], killed


def _gateway_metric(launcher, name: str) -> dict[str, float]:
    """The gateway's own samples of ``name`` by their ``engine`` label (the engine's DP rank)."""
    gateway = _role(launcher, "gateway")
    with urllib.request.urlopen(f"http://{gateway.metrics_address}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {s.labels["engine"]: s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == name}


def _engine_running(engine) -> float:
    """The engine's ``vllm:num_requests_running`` (0 while it has no snapshot)."""
    with urllib.request.urlopen(f"http://{engine.metrics_address}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "vllm:num_requests_running")


def _gateway_watches(logs) -> int:
    """How often a gateway subscribed to the coordinator's load (its log, across restarts)."""
    lines = (logs / "coordinator-0.log").read_text().splitlines()
    return sum("watches the load" in line and "gateway-" in line for line in lines)


def _same_as_fault_free(requests, clean, results):
    assert all(r.ok for r in clean), [r.error for r in clean if not r.ok]
    failed = {r.index: r.error or "no [DONE]" for r in results if not r.ok}
    assert not failed
    for request, before, after in zip(requests, clean, results):
        assert stream_faults(after, request) == [], request.index
        assert after.tokens == before.tokens, request.index  # one chunk per token: none twice, none lost
        assert after.text == before.text, request.index
        assert after.usage["prompt_tokens"] == before.usage["prompt_tokens"]
        assert after.usage["total_tokens"] == before.usage["prompt_tokens"] + request.max_tokens


def test_a_coordinator_killed_under_load_loses_no_request(served):
    launcher, logs, requests, clean = served
    coordinator = _role(launcher, "coordinator")
    watches_before = _gateway_watches(logs)
    results, killed = _load_with_kill(launcher, requests, lambda p: p.events >= STREAMS * MAX_TOKENS // 3,
                                      coordinator)
    _same_as_fault_free(requests, clean, results)
    # restarted by the launcher; the engines report to it and the gateway watches it again
    deadline = time.monotonic() + 60
    while coordinator.pid == killed["pid"] or coordinator.process.poll() is not None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    wait_until_serving(coordinator.address, timeout=30)
    with grpc.insecure_channel(coordinator.address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        while True:
            snapshot = next(stub.WatchLoad(coordinator_pb2.WatchLoadRequest(subscriber_id="test"), timeout=10))
            if sorted(e.dp_rank for e in snapshot.engines) == [0, 1]:
                break
            assert time.monotonic() < deadline, "the engines did not report to the new coordinator"
            time.sleep(0.1)
    while _gateway_watches(logs) <= watches_before:
        assert time.monotonic() < deadline, "the gateway did not watch the new coordinator"
        time.sleep(0.1)


def test_an_engine_killed_with_32_streams_in_flight_loses_no_token(served, capsys):
    launcher, logs, requests, clean = served
    engines = [_role(launcher, "engine", group=rank) for rank in (0, 1)]
    for engine in engines:
        wait_until_serving(engine.address, timeout=60)
    failovers = "gridserve:engine_failovers_total"
    continued_before = sum(_gateway_metric(launcher, failovers).values())

    running: dict[int, float] = {}

    def busy_enough(progress) -> bool:
        # every stream has its first tokens, and one engine is still generating for at least a quarter
        # of them: its own running gauge, read at most every 20 ms (the client lags the engine, so the
        # client's progress alone can come after the engine finished)
        if progress.events < STREAMS or time.monotonic() - running.get(-1, 0) < 0.02:
            return False
        running.update({e.group: _engine_running(e) for e in engines})
        running[-1] = time.monotonic()
        return max(running[e.group] for e in engines) >= STREAMS // 4

    def busier_engine():  # the one generating more of the 32 then
        return max(engines, key=lambda e: running[e.group])

    results, killed = _load_with_kill(launcher, requests, busy_enough, busier_engine)
    _same_as_fault_free(requests, clean, results)
    continued = sum(_gateway_metric(launcher, failovers).values()) - continued_before
    assert continued >= STREAMS // 4, f"only {continued} streams were on the killed engine (running: {running})"
    failover_s = resumed_after(results, killed["time"])
    pause_s = longest_pause(results, killed["time"])
    itl = sorted(b - a for r in clean for a, b in zip(r.chunk_times, r.chunk_times[1:]))
    with capsys.disabled():
        print(f"\nengine SIGKILL with {STREAMS} streams: {continued:.0f} continued on the other engine; "
              f"every stream's next token {failover_s:.3f} s after the kill; longest pause {pause_s:.3f} s "
              f"(fault-free inter-token p50 {itl[len(itl) // 2]:.3f} s, max {itl[-1]:.3f} s)")


@pytest.fixture(scope="module")
def single(llama_tiny, tmp_path_factory):
    saved, launcher_module.RESTART_BACKOFF_S = launcher_module.RESTART_BACKOFF_S, (0.2, 1.0)
    with deployment(llama_tiny, tmp_path_factory.mktemp("logs"), edge_port=free_port(),
                    engine_args=[*ENGINE_ARGS, "--batch-invariant"]) as launcher:  # as above
        thread = threading.Thread(target=launcher.supervise, kwargs={"poll_s": 0.05}, daemon=True)
        thread.start()
        yield launcher
    thread.join(timeout=30)
    launcher_module.RESTART_BACKOFF_S = saved


def test_with_one_engine_streams_wait_for_its_restart_and_continue(single):
    """DP = 1: the engine dies, the launcher restarts it with its worker, the streams pause and go on."""
    requests = make_requests(8, MAX_TOKENS)
    clean = run_load(single.edge_address, single.model, requests, len(requests))
    results, _ = _load_with_kill(single, requests, lambda p: p.events >= 8 * MAX_TOKENS // 4,
                                 _role(single, "engine"))
    _same_as_fault_free(requests, clean, results)
