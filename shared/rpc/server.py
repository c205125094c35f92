"""Server bootstrap shared by every role: a gRPC server with the error interceptor,
``grpc.health.v1`` and reflection, and a graceful SIGTERM / SIGINT drain.

A role builds a ``RpcServer``, registers its servicer, calls ``start()``, marks itself ready with
``set_serving(True)`` once it really is, and ``wait()``s. On SIGTERM the server reports
NOT_SERVING, runs the role's ``on_drain`` hook (stop taking work, finish or abort in-flight
requests), then stops with a grace period and ``wait()`` returns.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any, Optional

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gridserve.shared.rpc.client import SERVER_OPTIONS
from gridserve.shared.rpc.errors import AioErrorInterceptor, ErrorInterceptor

logger = logging.getLogger(__name__)


class RpcServer:
    """One gRPC server with health, reflection and graceful shutdown."""

    def __init__(self, host: str, port: int, max_workers: int = 32, grace_s: float = 10.0,
                 interceptors: Sequence[grpc.ServerInterceptor] = ()) -> None:
        self.grace_s = grace_s
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rpc"),
            interceptors=[*interceptors, ErrorInterceptor()],
            options=SERVER_OPTIONS,
        )
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._bind(host, port)

    def _bind(self, host: str, port: int) -> None:
        """Listen on ``host:port`` (0: a free port); NOT_SERVING until ``set_serving(True)``."""
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        self.address = f"{host}:{self.port}"
        self._services: list[str] = [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._shutting_down = False
        self.on_drain: Optional[Callable[[float], None]] = None
        self.set_serving(False)

    def add_service(self, full_name: str, register: Callable[[grpc.Server], None]) -> None:
        register(self.server)
        self._services.append(full_name)

    def start(self) -> None:
        reflection.enable_server_reflection([*self._services, reflection.SERVICE_NAME], self.server)
        self.server.start()
        logger.info("listening on %s (%s)", self.address, ", ".join(self._services))

    def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        self.health.set("", status)
        for name in getattr(self, "_services", []):
            self.health.set(name, status)

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, _frame: self._on_signal(signum))

    def _on_signal(self, signum: int) -> None:
        logger.info("signal %d: draining", signum)
        threading.Thread(target=self.shutdown, name="drain", daemon=True).start()

    def shutdown(self) -> None:
        """NOT_SERVING, drain the role, stop the server (idempotent)."""
        with self._lock:
            if self._shutting_down:
                return
            self._shutting_down = True
        self.set_serving(False)
        if self.on_drain is not None:
            try:
                self.on_drain(self.grace_s)
            except Exception:  # noqa: BLE001 - shutdown must go on
                logger.exception("drain failed")
        self._stop_server()
        self._stopped.set()

    def _stop_server(self) -> None:
        self.server.stop(self.grace_s).wait()

    def wait(self) -> None:
        """Block until ``shutdown`` completed."""
        while not self._stopped.wait(0.5):
            pass


class AioRpcServer(RpcServer):
    """``RpcServer`` on ``grpc.aio``, its event loop in a thread of its own: ``async def`` handlers
    run on the loop (one thread for every stream, no thread handoff per message), plain ones in a
    thread pool of ``max_workers``. Same API; interceptors must be ``grpc.aio.ServerInterceptor``."""

    def __init__(self, host: str, port: int, max_workers: int = 32, grace_s: float = 10.0,
                 interceptors: Sequence[grpc.aio.ServerInterceptor] = ()) -> None:
        import asyncio

        from grpc_health.v1.health import aio as health_aio

        self.grace_s = grace_s
        self.loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self.loop.run_forever, name="rpc-loop", daemon=True)
        self._loop_thread.start()

        async def build() -> grpc.aio.Server:
            return grpc.aio.server(
                futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rpc"),
                interceptors=[*interceptors, AioErrorInterceptor()],
                options=SERVER_OPTIONS,
            )

        self.server = self.run(build())
        self.health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._bind(host, port)

    def run(self, coroutine: Any, timeout: Optional[float] = None) -> Any:
        """Run ``coroutine`` on the server's loop from another thread and return its result."""
        import asyncio

        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def start(self) -> None:
        reflection.enable_server_reflection([*self._services, reflection.SERVICE_NAME], self.server)
        self.run(self.server.start())
        logger.info("listening on %s (%s, asyncio)", self.address, ", ".join(self._services))

    def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        names = ["", *getattr(self, "_services", [])]

        async def update() -> None:
            for name in names:
                await self.health.set(name, status)

        if threading.current_thread() is self._loop_thread:
            self.loop.create_task(update())
        else:
            self.run(update())

    def _stop_server(self) -> None:
        self.run(self.server.stop(self.grace_s))
        self.loop.call_soon_threadsafe(self.loop.stop)
