"""The launcher supervises: a role that dies is restarted and the deployment serves again.

One deployment (worker, engine, gateway, Envoy) supervised by ``Launcher.supervise`` in a thread,
as ``gridserve serve`` runs it; roles are SIGKILLed and the edge must answer a completion again.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest

from gridserve import launcher as launcher_module
from gridserve.launcher import free_port

from .services import deployment

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def supervised(llama_tiny, tmp_path_factory):
    saved, launcher_module.RESTART_BACKOFF_S = launcher_module.RESTART_BACKOFF_S, (0.2, 1.0)
    with deployment(llama_tiny, tmp_path_factory.mktemp("logs"), edge_port=free_port()) as launcher:
        thread = threading.Thread(target=launcher.supervise, kwargs={"poll_s": 0.05}, daemon=True)
        thread.start()
        yield launcher
    thread.join(timeout=30)
    launcher_module.RESTART_BACKOFF_S = saved
    assert not thread.is_alive(), "supervise() returns once the deployment stops"


def _complete(launcher, timeout: float = 5.0) -> int:
    body = json.dumps({"model": launcher.model, "prompt": "def f(", "max_tokens": 2}).encode()
    req = urllib.request.Request(f"http://{launcher.edge_address}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0


def _serves_again(launcher, within_s: float = 90.0) -> float:
    start = time.monotonic()
    while time.monotonic() - start < within_s:
        if _complete(launcher) == 200:
            return time.monotonic() - start
        time.sleep(0.2)
    raise AssertionError(f"no completion within {within_s} s")


def _kill(launcher, role: str) -> int:
    proc = next(p for p in launcher.processes if p.role == role)
    pid = proc.pid
    os.kill(pid, signal.SIGKILL)
    return pid


@pytest.mark.parametrize("role", ["gateway", "worker", "engine", "edge"])
def test_a_killed_role_is_restarted_and_the_deployment_serves_again(supervised, role):
    # Serving before the kill: the previous case's restart may still be within the edge's health
    # check interval (1 s) of the gateway being ready again (Envoy answers 503 until it re-checks).
    _serves_again(supervised, within_s=30)
    engine_pid = next(p.pid for p in supervised.processes if p.role == "engine")
    old = _kill(supervised, role)
    _serves_again(supervised)
    proc = next(p for p in supervised.processes if p.role == role)
    assert proc.pid != old and proc.process.poll() is None
    if role in ("worker", "engine"):
        group = [p for p in supervised.processes if p.group == proc.group]
        assert all(p.process.poll() is None for p in group) and len(group) == 2
    if role == "worker":  # restarted alone: its engine stayed up and rebuilt the group
        assert next(p.pid for p in supervised.processes if p.role == "engine") == engine_pid


def test_a_role_that_keeps_failing_at_start_ends_supervision(llama_tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(launcher_module, "RESTART_BACKOFF_S", (0.05, 0.1))
    with deployment(llama_tiny, tmp_path) as launcher:
        gateway = next(p for p in launcher.processes if p.role == "gateway")
        gateway.argv = (*gateway.argv, "--no-such-flag")  # every restart now fails at once
        os.kill(gateway.pid, signal.SIGKILL)
        failing = launcher.supervise(poll_s=0.05)
        assert failing is gateway
        assert failing.quick_failures == launcher_module.CRASH_LOOP_RESTARTS + 1


def test_an_engine_whose_workers_do_not_come_back_is_restarted_with_them(llama_tiny, tmp_path, monkeypatch):
    """Recovery off (``--worker-recovery-timeout 0``): the worker's death kills the engine, which
    stays up but not live; supervise() finds it by its liveness health and restarts the group."""
    monkeypatch.setattr(launcher_module, "RESTART_BACKOFF_S", (0.2, 1.0))
    monkeypatch.setattr(launcher_module, "LIVENESS_PERIOD_S", 0.5)
    engine_args = ["--kv-cache-memory-bytes", str(32 << 20), "--worker-recovery-timeout", "0"]
    with deployment(llama_tiny, tmp_path, edge_port=free_port(), engine_args=engine_args) as launcher:
        thread = threading.Thread(target=launcher.supervise, kwargs={"poll_s": 0.05}, daemon=True)
        thread.start()
        assert _complete(launcher, timeout=30) == 200
        engine_pid = next(p.pid for p in launcher.processes if p.role == "engine")
        _kill(launcher, "worker")
        _serves_again(launcher)
        engine = next(p for p in launcher.processes if p.role == "engine")
        assert engine.pid != engine_pid and engine.process.poll() is None
