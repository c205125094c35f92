"""Worker recovery: a worker SIGKILLed mid-generation is restarted alone by the launcher, the engine
rebuilds its group and every in-flight request completes with exactly the tokens of a fault-free run.

Real processes (worker(s), engine, gateway) supervised by ``Launcher.supervise`` in a thread, as
``gridserve serve`` runs them. Greedy and seeded requests stream through the gateway; the engine's
health is polled throughout (it must go NOT_SERVING, then SERVING again) and its ``/metrics`` must
count one recovery. The time from the kill to the first token after it is logged.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import urllib.request

import pytest

from gridserve import launcher as launcher_module
from gridserve.api.common.v1 import common_pb2
from gridserve.shared.rpc.client import health_status, make_channel

from .services import ENGINE_ARGS, address, deployment, gateway_stub, token_prompt

pytestmark = pytest.mark.slow
logger = logging.getLogger(__name__)

MAX_TOKENS = 96
PROMPTS = [[11, 12, 13, 14], [21, 22, 23], [31, 32, 33, 34, 35], [41, 42]]


def _params(i: int) -> common_pb2.SamplingParams:
    """Even rows greedy, odd rows seeded sampling; every row generates exactly MAX_TOKENS."""
    if i % 2 == 0:
        return common_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)
    return common_pb2.SamplingParams(temperature=1.0, top_p=0.9, seed=1000 + i, max_tokens=MAX_TOKENS,
                                     min_tokens=MAX_TOKENS)


class _Streams:
    """The requests streamed at once, one thread each; token arrival times kept."""

    def __init__(self, gateway: str) -> None:
        self.tokens: list[list[int]] = [[] for _ in PROMPTS]
        self.times: list[list[float]] = [[] for _ in PROMPTS]
        self.errors: list[BaseException] = []
        self.channel = make_channel(gateway)
        stub = gateway_stub(self.channel)
        self.threads = [threading.Thread(target=self._run, args=(stub, i), daemon=True) for i in range(len(PROMPTS))]
        for thread in self.threads:
            thread.start()

    def _run(self, stub, i: int) -> None:
        try:
            for response in stub.Generate(token_prompt(PROMPTS[i], _params(i)), timeout=180):
                self.tokens[i] += response.token_ids
                self.times[i] += [time.monotonic()] * len(response.token_ids)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.errors.append(exc)

    def wait_for(self, n: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while min(len(t) for t in self.tokens) < n:
            assert not self.errors, self.errors
            assert time.monotonic() < deadline, "the streams did not start"
            time.sleep(0.005)

    def join(self) -> list[list[int]]:
        for thread in self.threads:
            thread.join(timeout=200)
        self.channel.close()
        assert not self.errors, self.errors
        return self.tokens


class _HealthLog:
    """The engine's readiness (health service "") sampled every 20 ms, changes only."""

    def __init__(self, engine: str) -> None:
        self.states: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(engine,), daemon=True)
        self._thread.start()

    def _run(self, engine: str) -> None:
        with make_channel(engine) as channel:
            while not self._stop.is_set():
                status = health_status(channel, timeout=1.0)
                if not self.states or self.states[-1] != status:
                    self.states.append(status)
                time.sleep(0.02)

    def stop(self) -> list[str]:
        self._stop.set()
        self._thread.join(timeout=5)
        return self.states


def _resumed_at(times: list[list[float]], killed_at: float) -> float:
    """When tokens flowed again: the end of the longest pause in arrivals after the kill (tokens of
    steps that finished just before it may still arrive right after it)."""
    after = sorted(t for ts in times for t in ts if t >= killed_at)
    arrivals = [killed_at, *after]
    gaps = [(b - a, b) for a, b in zip(arrivals, arrivals[1:])]
    return max(gaps)[1]


def _recoveries(launcher) -> float:
    engine = next(p for p in launcher.processes if p.role == "engine")
    with urllib.request.urlopen(f"http://{engine.metrics_address}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    line = next(line for line in text.splitlines() if line.startswith("gridserve:worker_recoveries_total"))
    return float(line.split()[-1])


@pytest.fixture
def fast_restarts(monkeypatch):
    monkeypatch.setattr(launcher_module, "RESTART_BACKOFF_S", (0.1, 1.0))


@pytest.mark.parametrize("tp,pp,victim", [(1, 1, 0), (2, 1, 1), (1, 2, 0)], ids=["tp1", "tp2-rank1", "pp2-rank0"])
def test_killed_worker_is_restarted_and_every_request_completes_unchanged(
        llama_tiny, tmp_path, fast_restarts, tp, pp, victim):
    engine_args = [*ENGINE_ARGS, "--worker-recovery-timeout", "90"]
    with deployment(llama_tiny, tmp_path, engine_args=engine_args, tensor_parallel_size=tp,
                    pipeline_parallel_size=pp) as launcher:
        supervisor = threading.Thread(target=launcher.supervise, kwargs={"poll_s": 0.02}, daemon=True)
        supervisor.start()
        gateway = address(launcher, "gateway")
        reference = _Streams(gateway).join()  # the fault-free run
        assert all(len(t) == MAX_TOKENS for t in reference)

        health = _HealthLog(address(launcher, "engine"))
        streams = _Streams(gateway)
        streams.wait_for(4)
        workers = [p for p in launcher.processes if p.role == "worker"]
        old_pids = [w.pid for w in workers]
        engine = next(p for p in launcher.processes if p.role == "engine")
        engine_pid = engine.pid
        os.kill(workers[victim].pid, signal.SIGKILL)
        killed_at = time.monotonic()
        at_kill = [len(t) for t in streams.tokens]
        outputs = streams.join()
        states = health.stop()

        assert max(at_kill) < MAX_TOKENS, "the requests finished before the kill: nothing was tested"
        assert outputs == reference
        logger.warning("TP=%d PP=%d: worker kill -> first token after the recovery: %.2f s", tp, pp,
                       _resumed_at(streams.times, killed_at) - killed_at)
        assert "NOT_SERVING" in states and states[-1] == "SERVING", states
        assert states.index("NOT_SERVING") < len(states) - 1
        assert _recoveries(launcher) == 1.0
        assert all(w.process.poll() is None for w in workers)
        assert all(w.pid != old for w, old in zip(workers, old_pids)), "every rank of the group restarted"
        assert engine.pid == engine_pid and engine.process.poll() is None  # the engine was never restarted


def test_a_worker_that_hangs_then_comes_back_is_reinitialized_in_place(llama_tiny, tmp_path, monkeypatch):
    """SIGSTOP, not SIGKILL: the engine gives up on the silent worker when its step times out
    (``GRIDSERVE_STEP_TIMEOUT_S``, 5 s here) and recovers; once the same process answers again
    (SIGCONT) it is initialized anew (world size 1 needs no fresh process) and every request
    completes unchanged."""
    monkeypatch.setenv("GRIDSERVE_STEP_TIMEOUT_S", "5")  # inherited by the engine process
    engine_args = [*ENGINE_ARGS, "--worker-recovery-timeout", "90"]
    with deployment(llama_tiny, tmp_path, engine_args=engine_args) as launcher:
        gateway = address(launcher, "gateway")
        reference = _Streams(gateway).join()
        health = _HealthLog(address(launcher, "engine"))
        streams = _Streams(gateway)
        streams.wait_for(4)
        worker = next(p for p in launcher.processes if p.role == "worker")
        os.kill(worker.pid, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 30
            while "NOT_SERVING" not in health.states:  # the engine gave up on the stream: recovering
                assert time.monotonic() < deadline, health.states
                time.sleep(0.05)
        finally:
            os.kill(worker.pid, signal.SIGCONT)
        outputs = streams.join()
        states = health.stop()
        assert outputs == reference
        assert states[-1] == "SERVING" and _recoveries(launcher) == 1.0
        assert worker.process.poll() is None and next(p for p in launcher.processes if p.role == "worker") is worker


def test_a_hung_worker_is_noticed_by_keepalive_and_restarted_by_its_liveness(
        llama_tiny, tmp_path, fast_restarts, monkeypatch):
    """SIGSTOP and no SIGCONT, with the default 120 s step timeout: the engine's keepalive pings go
    unanswered, so its worker stream breaks within seconds and it recovers; the launcher finds the
    worker's liveness unanswered ``LIVENESS_FAILURE_THRESHOLD`` times in a row, kills and restarts it
    (as a Kubernetes liveness probe would), and every request completes unchanged."""
    monkeypatch.setattr(launcher_module, "LIVENESS_PERIOD_S", 1.0)
    engine_args = [*ENGINE_ARGS, "--worker-recovery-timeout", "90"]
    with deployment(llama_tiny, tmp_path, engine_args=engine_args) as launcher:
        supervisor = threading.Thread(target=launcher.supervise, kwargs={"poll_s": 0.02}, daemon=True)
        supervisor.start()
        gateway = address(launcher, "gateway")
        reference = _Streams(gateway).join()
        health = _HealthLog(address(launcher, "engine"))
        streams = _Streams(gateway)
        streams.wait_for(4)
        worker = next(p for p in launcher.processes if p.role == "worker")
        hung = worker.process
        os.kill(hung.pid, signal.SIGSTOP)
        stopped_at = time.monotonic()
        try:
            deadline = stopped_at + 20
            while "NOT_SERVING" not in health.states:  # keepalive, not the 120 s step timeout
                assert time.monotonic() < deadline, health.states
                time.sleep(0.05)
            noticed = time.monotonic() - stopped_at
            outputs = streams.join()
        finally:
            if hung.poll() is None:
                os.kill(hung.pid, signal.SIGCONT)
        states = health.stop()
        logger.warning("hung worker: noticed by the engine after %.1f s; restarted pid %d -> %d", noticed,
                       hung.pid, worker.pid)
        assert outputs == reference
        assert hung.poll() is not None and worker.process is not hung, "the hung worker was restarted"
        assert states[-1] == "SERVING" and _recoveries(launcher) == 1.0
