"""``grpc.health.v1`` ``Watch`` through the error interceptor (the gateway's engine clients watch
each engine's readiness with it): every change of the role's ``Readiness`` arrives on the stream.
Before the fix the interceptor wrapped the health servicer's ``context.write`` handler as a plain
generator and every Watch failed with INTERNAL."""

from __future__ import annotations

import queue
import threading

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gridserve.shared.readiness import State
from gridserve.shared.rpc.server import RpcServer

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def test_watch_streams_every_readiness_change():
    server = RpcServer("127.0.0.1", 0, grace_s=0.5, role="test")
    server.start()
    seen: queue.Queue = queue.Queue()
    try:
        with grpc.insecure_channel(server.address) as channel:
            call = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=20)

            def read() -> None:
                try:
                    for response in call:
                        seen.put(response.status)
                except grpc.RpcError:
                    pass  # cancelled at the end

            reader = threading.Thread(target=read, daemon=True)
            reader.start()
            assert seen.get(timeout=10) == NOT_SERVING  # loading
            server.readiness.set(State.READY)
            assert seen.get(timeout=10) == SERVING
            server.readiness.set(State.SLEEPING, "sleep level 1")
            assert seen.get(timeout=10) == NOT_SERVING
            call.cancel()
    finally:
        server.shutdown()
