"""The one asyncio RPC layer every role shares: ``RpcServer`` (health, errors, drain),
``LoopThread`` and ``ReconnectingStream``, on real gRPC over loopback."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gridserve.shared.errors import InvalidArgumentError
from gridserve.shared.readiness import LIVENESS_SERVICE, State
from gridserve.shared.rpc.client import health_status, make_channel
from gridserve.shared.rpc.loop_thread import LoopThread
from gridserve.shared.rpc.reconnect import ReconnectingStream
from gridserve.shared.rpc.server import RpcServer


class _Failing(health_pb2_grpc.HealthServicer):
    """A service whose async handlers raise a typed error (to see the interceptor map it)."""

    async def Check(self, request, context):
        raise InvalidArgumentError("service", f"{request.service!r} is not a service here")

    async def Watch(self, request, context):
        raise InvalidArgumentError("service", "no watching")
        yield  # pragma: no cover - an async generator that raises at once


def test_server_is_not_serving_until_ready_maps_typed_errors_and_drains_on_shutdown():
    server = RpcServer("127.0.0.1", 0, grace_s=1.0)
    drained = []
    server.on_drain = drained.append
    server.start()
    with make_channel(server.address) as channel:
        assert health_status(channel) == "NOT_SERVING"
        server.readiness.set(State.READY)
        assert health_status(channel) == "SERVING"
        server.shutdown()
        assert drained == [1.0]  # the role's drain ran with the grace period
        assert health_status(channel, timeout=0.5) == "UNREACHABLE"
    server.wait()  # returns: the shutdown completed


def test_liveness_is_its_own_health_service_and_follows_the_watchdog():
    server = RpcServer("127.0.0.1", 0, grace_s=0.5, role="test")
    server.start()
    try:
        with make_channel(server.address) as channel:
            # Loading: not ready, but live (a liveness probe must not restart a loading role).
            assert health_status(channel) == "NOT_SERVING"
            assert health_status(channel, service=LIVENESS_SERVICE) == "SERVING"
            server.readiness.set(State.READY)
            server.readiness.set(State.SLEEPING)
            assert health_status(channel) == "NOT_SERVING"
            assert health_status(channel, service=LIVENESS_SERVICE) == "SERVING"
            server.readiness.set(State.READY)
            server.readiness.arm_watchdog(0.3)  # nobody beats: within ~1 s it is not live
            deadline = time.monotonic() + 5
            while health_status(channel, service=LIVENESS_SERVICE) == "SERVING" and time.monotonic() < deadline:
                time.sleep(0.1)
            assert health_status(channel, service=LIVENESS_SERVICE) == "NOT_SERVING"
            server.readiness.beat()
            server.readiness.arm_watchdog(60)
            deadline = time.monotonic() + 5
            while health_status(channel, service=LIVENESS_SERVICE) != "SERVING" and time.monotonic() < deadline:
                time.sleep(0.1)
            assert health_status(channel, service=LIVENESS_SERVICE) == "SERVING"
    finally:
        server.shutdown()
    assert server.readiness.state is State.DEAD


def test_error_interceptor_turns_a_typed_error_of_an_async_handler_into_its_status():
    server = RpcServer("127.0.0.1", 0, grace_s=0.5)
    # Registered under another name so the real health service stays in place.
    failing = _Failing()
    rpc = grpc.method_handlers_generic_handler("test.Failing", {
        "Check": grpc.unary_unary_rpc_method_handler(
            failing.Check, health_pb2.HealthCheckRequest.FromString,
            health_pb2.HealthCheckResponse.SerializeToString),
        "Watch": grpc.unary_stream_rpc_method_handler(
            failing.Watch, health_pb2.HealthCheckRequest.FromString,
            health_pb2.HealthCheckResponse.SerializeToString),
    })
    server.add_service("test.Failing", lambda s: s.add_generic_rpc_handlers((rpc,)))
    server.start()
    try:
        with make_channel(server.address) as channel:
            check = channel.unary_unary("/test.Failing/Check",
                                        request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                                        response_deserializer=health_pb2.HealthCheckResponse.FromString)
            with pytest.raises(grpc.RpcError) as err:
                check(health_pb2.HealthCheckRequest(service="x"), timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "service" in err.value.details()
            watch = channel.unary_stream("/test.Failing/Watch",
                                         request_serializer=health_pb2.HealthCheckRequest.SerializeToString,
                                         response_deserializer=health_pb2.HealthCheckResponse.FromString)
            with pytest.raises(grpc.RpcError) as err:
                list(watch(health_pb2.HealthCheckRequest(), timeout=5))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        server.shutdown()


def test_loop_thread_runs_coroutines_for_other_threads_and_refuses_to_wait_on_itself():
    runner = LoopThread("test-loop")
    try:
        assert runner.run(asyncio.sleep(0, result=7), timeout=5) == 7
        assert runner.call(runner.in_loop, timeout=5) is True
        assert runner.in_loop() is False

        async def nested() -> None:
            runner.run(asyncio.sleep(0))

        with pytest.raises(RuntimeError, match="own loop"):
            runner.run(nested(), timeout=5)
    finally:
        runner.stop()


def test_reconnecting_stream_reopens_after_each_failure_until_the_session_says_stop():
    async def scenario() -> None:
        sessions, lost = [], []

        async def session() -> bool:
            sessions.append(len(sessions))
            if len(sessions) < 3:  # two broken streams, then one the server ends, for good
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, None, None, details="gone")
            return False

        stream = ReconnectingStream("test", session, lost.append, delay_s=0.01)
        await asyncio.wait_for(stream._task, 5)
        assert sessions == [0, 1, 2]
        assert lost == ["UNAVAILABLE: gone", "UNAVAILABLE: gone", "the server ended the stream"]

        opened = asyncio.Event()

        async def forever() -> None:
            opened.set()
            await asyncio.Event().wait()

        lost.clear()
        held = ReconnectingStream("held", forever, lost.append, delay_s=0.01)
        await asyncio.wait_for(opened.wait(), 5)
        await held.close()  # cancels the open stream; no on_lost, no new session
        assert held._task.done() and lost == []

    asyncio.run(scenario())
