"""The DP coordinator dies and comes back: the gateway's router falls back to its own counts while
it is gone, the engines' load reports and the gateway's subscription resume when it returns, and
an MoE engine's ``WaveClient`` joins the new coordinator's waves although its wave numbers start
again at 0. In-process coordinator servers on one port; clients on a loop of their own."""

from __future__ import annotations

import time

import grpc
import pytest

from gridserve.api.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from gridserve.launcher import free_port
from gridserve.services.coordinator.load_table import LoadTable
from gridserve.services.coordinator.servicer import CoordinatorServicer
from gridserve.services.coordinator.waves import Waves
from gridserve.services.engine.load_reporter import LoadReporter
from gridserve.services.engine.waves import WaveClient
from gridserve.services.gateway.load_watcher import LoadWatcher
from gridserve.services.gateway.router import Router
from gridserve.shared.load import EngineLoad
from gridserve.shared.readiness import State
from gridserve.shared.rpc.loop_thread import LoopThread
from gridserve.shared.rpc.server import RpcServer


def _wait(predicate, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _coordinator(port: int, dp_size: int) -> RpcServer:
    server = RpcServer("127.0.0.1", port, max_workers=16, grace_s=0.5)
    table = LoadTable()
    servicer = CoordinatorServicer(table, Waves(dp_size, on_change=table.bump))
    name = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name
    server.add_service(name, lambda s: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, s))
    server.on_drain = lambda timeout: servicer.stopping.set()
    server.start()
    server.readiness.set(State.READY)
    return server


@pytest.fixture
def clients():
    loop = LoopThread("test-clients")
    yield loop
    loop.stop()


def test_routing_and_waves_survive_a_coordinator_restart(clients, monkeypatch):
    monkeypatch.setattr("gridserve.shared.rpc.reconnect.RECONNECT_DELAY_S", 0.1)
    port = free_port()
    address = f"127.0.0.1:{port}"
    first = _coordinator(port, dp_size=1)
    router = Router(1)
    watcher = clients.call(lambda: LoadWatcher(address, "gw-test", router))
    reporter = clients.call(lambda: LoadReporter(address, 0, "127.0.0.1:9000", interval_s=0.2))
    waves = clients.call(lambda: WaveClient(address, 0))
    second = None
    try:
        reporter.offer(EngineLoad(3, 1, 0.0))
        _wait(lambda: router._reported[0] == EngineLoad(3, 1, 0.0))
        waves.on_request()  # wave 0 at the first coordinator; one engine: the barrier is ours alone
        waves.after_step(unfinished=False, dummy=False)
        assert (waves.wave, waves.next_wave, waves.waves_completed) == (None, 1, 1)

        first.shutdown()  # the coordinator is gone: routing by this gateway's own counts
        _wait(lambda: router._reported[0] is None)
        assert router.choose([True], [0]) == 0
        with pytest.raises(grpc.RpcError):
            waves.on_request()  # the engine loop logs this and serves the request anyway
        assert waves.wave is None

        second = _coordinator(port, dp_size=2)  # restarted: its wave numbers begin at 0 again
        reporter.offer(EngineLoad(5, 2, 0.0))
        _wait(lambda: router._reported[0] == EngineLoad(5, 2, 0.0))  # both streams resubscribed
        with grpc.insecure_channel(address) as channel:  # engine 1 starts wave 0 at the new coordinator
            started = coordinator_pb2_grpc.CoordinatorStub(channel).StartWave(
                coordinator_pb2.StartWaveRequest(dp_rank=1), timeout=5)
        assert started.wave == 0
        _wait(waves.poll)  # joins wave 0 although it had done wave 0 at the old coordinator
        assert waves.wave == 0
    finally:
        for client in (watcher, reporter, waves):
            clients.run(client.close())
        for server in (first, second):
            if server is not None:
                server.shutdown()
