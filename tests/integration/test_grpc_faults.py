"""Faults across the process boundaries: a killed worker, and the launcher's own lifecycle."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from gridserve.api.common.v1 import common_pb2
from gridserve.launcher import free_port
from gridserve.shared.rpc.client import health_status, make_channel

from .services import (
    ENGINE_ARGS,
    KV_BYTES,
    address,
    deployment,
    gateway_stub,
    greedy,
    pid,
    token_prompt,
)

pytestmark = pytest.mark.slow


def _alive(process_id: int) -> bool:
    try:
        os.kill(process_id, 0)
    except ProcessLookupError:
        return False
    return True


def test_without_recovery_a_killed_worker_fails_in_flight_requests_with_unavailable_within_5s(llama_tiny, tmp_path, monkeypatch):
    """``--worker-recovery-timeout 0``: fail-stop, as before recovery (tests/integration/test_worker_recovery.py)."""
    engine_args = [*ENGINE_ARGS, "--worker-recovery-timeout", "0"]
    # Unsupervised and DP = 1: no engine comes back to continue on (tests/integration/test_failover.py)
    monkeypatch.setenv("GRIDSERVE_FAILOVER_TIMEOUT_S", "0")
    with deployment(llama_tiny, tmp_path, engine_args=engine_args) as services, \
            make_channel(address(services, "gateway")) as channel:
        gateway = gateway_stub(channel)
        call = gateway.Generate(token_prompt([11, 12, 13], greedy(500, ignore_eos=True)), timeout=120)
        next(call)
        os.kill(pid(services, "worker"), signal.SIGKILL)
        killed_at = time.monotonic()
        with pytest.raises(grpc.RpcError) as info:
            for _ in call:
                pass
        assert time.monotonic() - killed_at < 5
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "worker" in info.value.details()
        with make_channel(address(services, "engine")) as engine:
            assert health_status(engine) == health_pb2.HealthCheckResponse.ServingStatus.Name(
                health_pb2.HealthCheckResponse.NOT_SERVING)
        with pytest.raises(grpc.RpcError) as later:
            gateway.Complete(token_prompt([11, 12], greedy(2)), timeout=10)
        assert later.value.code() == grpc.StatusCode.UNAVAILABLE


def test_serve_prints_the_process_table_and_sigterm_drains_then_stops_every_process(llama_tiny, tmp_path):
    cmd = [sys.executable, "-m", "gridserve.cli", "serve", str(llama_tiny), "--kv-cache-memory-bytes",
           str(KV_BYTES), "--log-dir", str(tmp_path), "--grace-period", "20", "--port", str(free_port())]
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        lines = []
        for line in launcher.stdout:
            lines.append(line)
            if line.startswith("gridserve ready"):
                break
        table = "".join(lines)
        assert "processes: A + DP + N (+1 coordinator when DP > 1) = 1 + 1 + 1 = 3" in table, table
        pids = {role: int(p) for role, p in re.findall(r"^(worker|engine|gateway|edge)\s+(\d+)\s", table, re.M)}
        assert set(pids) == {"worker", "engine", "gateway", "edge"}
        gateway = re.search(r"^gateway\s+\d+\s+(\S+)", table, re.M).group(1)
        with make_channel(gateway) as channel:
            assert health_status(channel) == "SERVING"
            in_flight = gateway_stub(channel).Generate(token_prompt([7, 8, 9], greedy(100, ignore_eos=True)),
                                                       timeout=60)
            tokens = list(next(in_flight).token_ids)
            launcher.send_signal(signal.SIGTERM)  # the request in flight still completes (drain)
            for response in in_flight:
                tokens += response.token_ids
            assert len(tokens) == 100 and response.finish_reason == common_pb2.FINISH_REASON_LENGTH
        out, _ = launcher.communicate(timeout=60)
        assert launcher.returncode == 0
        assert re.search(r"gridserve stopped: \{'edge-\d+': 0, 'gateway-\d+': 0, 'engine-\d+': 0, 'worker-\d+': 0\}", out), out
        assert not any(_alive(p) for p in pids.values())
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
