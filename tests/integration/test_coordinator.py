"""The DP coordinator over real gRPC on loopback: engines' LoadReporters stream load in, a
gateway's LoadWatcher hands it to its Router; an engine that stops reporting leaves the table.
The clients run on an event loop of their own, as they do on a role's server loop."""

from __future__ import annotations

import time

import pytest

from gridserve.api.coordinator.v1 import coordinator_pb2
from gridserve.services.coordinator.load_table import LoadTable
from gridserve.services.coordinator.servicer import CoordinatorServicer
from gridserve.services.coordinator.waves import Waves
from gridserve.services.engine.load_reporter import LoadReporter
from gridserve.services.gateway.load_watcher import LoadWatcher
from gridserve.services.gateway.router import Router
from gridserve.shared.load import EngineLoad
from gridserve.shared.readiness import State
from gridserve.shared.rpc.loop_thread import LoopThread
from gridserve.shared.rpc.server import RpcServer


def _wait(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.fixture
def coordinator():
    from gridserve.api.coordinator.v1 import coordinator_pb2_grpc

    server = RpcServer("127.0.0.1", 0, max_workers=16, grace_s=1.0)
    table = LoadTable()
    servicer = CoordinatorServicer(table, Waves(2, on_change=table.bump))
    name = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name
    server.add_service(name, lambda s: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, s))
    server.on_drain = lambda timeout: servicer.stopping.set()
    server.start()
    server.readiness.set(State.READY)
    yield server, servicer
    server.shutdown()


def test_reports_reach_the_gateways_router_promptly_and_a_silent_engine_leaves(coordinator):
    server, servicer = coordinator
    router = Router(2)
    clients = LoopThread("test-clients")
    watcher = clients.call(lambda: LoadWatcher(server.address, "gw-test", router))
    reporters = clients.call(lambda: [LoadReporter(server.address, r, f"127.0.0.1:{9000 + r}", interval_s=5.0)
                                      for r in range(2)])
    try:
        for reporter in reporters:
            reporter.offer(EngineLoad(0, 0, 0.0))  # as the engine loop does when it starts
        _wait(lambda: router._reported[0] is not None and router._reported[1] is not None)
        assert reporters[0].reports == 1
        reporters[0].offer(EngineLoad(0, 0, 0.0))  # no change: nothing sent before the interval
        reporters[0].offer(EngineLoad(7, 30, 0.75))
        # A change is published at once (well before the 1 s periodic snapshot and the 5 s report interval).
        start = time.monotonic()
        _wait(lambda: router._reported[0] == EngineLoad(7, 30, 0.75))
        assert time.monotonic() - start < 1.0
        assert router.choose([True, True], [0, 0]) == 1  # the loaded engine is avoided
        assert reporters[0].reports == 2
        version, table = servicer.table.snapshot()
        assert [x.dp_rank for x in table] == [0, 1] and table[0].address == "127.0.0.1:9000"
        reporters[0].offer(None)  # engine 0 dies: its stream ends, the coordinator forgets it
        _wait(lambda: router._reported[0] is None)
        assert [x.dp_rank for x in servicer.table.snapshot()[1]] == [1]
        assert watcher.snapshots >= 2
    finally:
        for client in [*reporters, watcher]:
            clients.run(client.close())
        clients.stop()


def test_prefix_digests_reach_the_gateways_router_and_follow_evictions(coordinator):
    from gridserve.shared.prefix_digest import PrefixDigest

    server, servicer = coordinator
    router = Router(2, "prefix")
    clients = LoopThread("test-clients")
    digests = [PrefixDigest(16, 64), PrefixDigest(16, 64)]
    watcher = clients.call(lambda: LoadWatcher(server.address, "gw-digest", router))
    reporters = clients.call(lambda: [LoadReporter(server.address, r, f"127.0.0.1:{9100 + r}", interval_s=5.0,
                                                   digest=digests[r]) for r in range(2)])
    try:
        for reporter in reporters:
            reporter.offer(EngineLoad(0, 0, 0.0))
        _wait(lambda: all(d is not None and d.known for d in router.digests))
        assert router.block_size == 16
        for n in (1, 2, 3):
            digests[1].block_stored(n.to_bytes(8, "little"))  # the engine cached three blocks
        reporters[1].offer(EngineLoad(0, 0, 0.0))  # the same load: sent for the digest alone
        _wait(lambda: router.digests[1].keys == {1, 2, 3})
        assert router.choose([True, True], [0, 0], prefix_keys=[1, 2, 3, 4]) == 1
        digests[1].block_removed((1).to_bytes(8, "little"))  # evicted
        reporters[1].offer(EngineLoad(0, 0, 0.0))
        _wait(lambda: router.digests[1].keys == {2, 3})
        reporters[1].offer(None)  # engine 1 dies: its digest is forgotten with it
        _wait(lambda: router.digests[1] is None)
    finally:
        for client in [*reporters, watcher]:
            clients.run(client.close())
        clients.stop()
