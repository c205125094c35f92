"""``RpcServer``: the one gRPC server every role runs, on ``grpc.aio``.

It carries the error interceptor, ``grpc.health.v1`` and reflection, and a graceful SIGTERM /
SIGINT drain. Its event loop runs in a thread of its own (``LoopThread``), so a role's ``main``
stays a plain function: it builds the server, registers its servicer, calls ``start()``, marks
itself ready with ``readiness.set(State.READY)`` once it really is, and ``wait()``s. ``async def`` handlers
run on the loop (one thread serves every stream); a role's blocking work (the engine's busy loop,
the worker's forward pass) lives in threads of its own and hands results to the loop.

Health follows the role's ``Readiness`` (``gridserve.shared.readiness``): readiness is service
``""`` and every service the role added (SERVING only in READY); liveness is service ``"liveness"``
(SERVING unless DEAD or the role's watchdog fired; checked every second).

With TLS files (``shared.rpc.tls``: the role's ``--tls-*`` flags) the port takes only mutual TLS and
every call passes ``AuthorizationInterceptor`` (``shared.rpc.authz``: the caller's certificate
names a role the method's row allows; with ``--tls-deployment``, a name scoped to this deployment);
SIGHUP re-reads the files. Without them it is plaintext, and
plaintext never leaves loopback silently: a plaintext server asked to bind any other address
refuses to start (``ConfigError`` naming ``--insecure-internal``) unless the process was told
``--insecure-internal`` (``GRIDSERVE_INSECURE_INTERNAL=1``; then it warns), and a plaintext server
answers the operator's methods (``authz.OPERATOR_ONLY``) only to loopback peers
(``LoopbackAdminInterceptor``). ``health_port`` adds a plaintext port serving ``grpc.health.v1``
alone (the same statuses), for Kubernetes' probes, which cannot speak TLS.

On SIGTERM the server goes DRAINING (NOT_SERVING for readiness), runs the role's ``on_drain`` hook (stop taking work,
finish or abort in-flight requests, close the role's clients on the loop), then stops with a grace
period, stops the loop, and ``wait()`` returns.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import signal
import threading
from collections.abc import Callable, Coroutine, Sequence
from concurrent import futures
from typing import Any, Optional, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from gridserve.shared import envs
from gridserve.shared.errors import ConfigError
from gridserve.shared.readiness import LIVENESS_SERVICE, Readiness, State
from gridserve.shared.rpc import authz
from gridserve.shared.rpc import tls as tls_config
from gridserve.shared.rpc.authz import AuthorizationInterceptor, LoopbackAdminInterceptor
from gridserve.shared.rpc.client import SERVER_OPTIONS
from gridserve.shared.rpc.errors import ErrorInterceptor
from gridserve.shared.rpc.loop_thread import LoopThread

logger = logging.getLogger(__name__)

T = TypeVar("T")
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
WATCHDOG_POLL_S = 1.0
INSECURE_INTERNAL_FLAG = "--insecure-internal"
_insecure_internal: Optional[bool] = None  # this process's choice; None: the variable's


def allow_insecure_internal(allowed: Optional[bool]) -> None:
    """Whether this process's plaintext servers may bind beyond loopback (the CLI's
    ``--insecure-internal``); None: ``GRIDSERVE_INSECURE_INTERNAL`` decides (library processes)."""
    global _insecure_internal
    _insecure_internal = allowed


def insecure_internal_allowed() -> bool:
    if _insecure_internal is not None:
        return _insecure_internal
    return bool(envs.flag_default(INSECURE_INTERNAL_FLAG, False, envs._bool))


def insecure_internal_env() -> dict[str, str]:
    """The environment that hands this process's ``--insecure-internal`` on to a child role."""
    return {envs.flag_env_name(INSECURE_INTERNAL_FLAG): "1"} if insecure_internal_allowed() else {}


def is_loopback_host(host: str) -> bool:
    """Whether a bind address is this machine's loopback only (``127.x``, ``::1``, ``localhost``)."""
    name = host.strip("[]").lower()
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def check_plaintext_bind(host: str, role: str, insecure_internal: bool) -> None:
    """Refuse a plaintext bind beyond loopback unless ``insecure_internal`` (then warn)."""
    if is_loopback_host(host):
        return
    what = f"the {role or 'server'} would listen on {host} in plaintext"
    if not insecure_internal:
        raise ConfigError(INSECURE_INTERNAL_FLAG.lstrip("-"), f"{what}, where anyone who reaches it can call it: "
                          "give it mutual TLS (--tls-cert-file, --tls-key-file, --tls-ca-file), bind 127.0.0.1, "
                          f"or accept plaintext on a trusted network with {INSECURE_INTERNAL_FLAG} "
                          f"({envs.flag_env_name(INSECURE_INTERNAL_FLAG)}=1)")
    logger.warning("%s (%s): anyone who reaches it can call its request API; the operator's methods "
                   "answer loopback callers only", what, INSECURE_INTERNAL_FLAG)


class RpcServer:
    """One ``grpc.aio`` server with health, reflection and graceful shutdown.

    ``max_workers`` sizes the pool that runs plain (non-``async``) handlers, if a role has any.
    ``tls``: this process's TLS files (default: those the CLI configured; None: plaintext).
    ``insecure_internal``: a plaintext server may bind beyond loopback (default: the process's
    ``--insecure-internal``).
    """

    def __init__(self, host: str, port: int, max_workers: int = 8, grace_s: float = 10.0,
                 interceptors: Sequence[grpc.aio.ServerInterceptor] = (), role: str = "",
                 health_port: Optional[int] = None, tls: Optional[tls_config.TlsFiles] = None,
                 insecure_internal: Optional[bool] = None) -> None:
        self.tls = tls or tls_config.active()
        if self.tls is None:
            check_plaintext_bind(host, role, insecure_internal_allowed() if insecure_internal is None
                                 else insecure_internal)
        # The deployment peers must belong to (``authz.Deployment``): a bad value fails the start.
        self.deployment = authz.deployment() if self.tls is not None else None
        self.grace_s = grace_s
        self.readiness = Readiness(role)
        self.runner = LoopThread("rpc-loop")
        self.loop = self.runner.loop
        self.authorization = AuthorizationInterceptor(role) if self.tls is not None else None
        first = [self.authorization] if self.authorization is not None else [LoopbackAdminInterceptor(role)]
        self.server: grpc.aio.Server = self.runner.call(lambda: grpc.aio.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rpc"),
            interceptors=[*first, *interceptors, ErrorInterceptor()],
            options=SERVER_OPTIONS,
        ))
        self.health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if self.tls is not None:
            self.port = self.server.add_secure_port(f"{host}:{port}", self.tls.server_credentials())
        else:
            self.port = self.server.add_insecure_port(f"{host}:{port}")  # 0: a free port
        self.address = f"{host}:{self.port}"
        self.health_server: Optional[grpc.aio.Server] = None
        self.health_port: Optional[int] = None
        if health_port is not None:  # plaintext, grpc.health.v1 alone: the probes' port
            self.health_server = self.runner.call(lambda: grpc.aio.server(options=SERVER_OPTIONS))
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
            self.health_port = self.health_server.add_insecure_port(f"{host}:{health_port}")
        self._services: list[str] = [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._shutting_down = False
        self.on_drain: Optional[Callable[[float], None]] = None
        self._live: Optional[bool] = None
        self._watchdog_task: Optional[Any] = None
        self.readiness.watch(lambda _state, _reason: self._publish_health())
        self._publish_health()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: Optional[float] = None) -> T:
        """Run ``coroutine`` on the server's loop from another thread and return its result."""
        return self.runner.run(coroutine, timeout)

    def call(self, fn: Callable[[], T], timeout: Optional[float] = None) -> T:
        """Run ``fn`` on the server's loop (build a role's asyncio clients there)."""
        return self.runner.call(fn, timeout)

    def add_service(self, full_name: str, register: Callable[[grpc.aio.Server], None]) -> None:
        register(self.server)
        self._services.append(full_name)
        self._publish_health()

    def start(self) -> None:
        reflection.enable_server_reflection([*self._services, reflection.SERVICE_NAME], self.server)
        self.run(self.server.start())
        if self.health_server is not None:
            self.run(self.health_server.start())
            logger.info("health (plaintext, probes only) on %s:%d", self.address.rpartition(":")[0],
                        self.health_port)
        self._watchdog_task = self.call(lambda: self.loop.create_task(self._watch_liveness()))
        scope = f" of deployment {self.deployment.name}" if self.deployment is not None else ""
        logger.info("listening on %s (%s)%s", self.address, ", ".join(self._services),
                    f" with mutual TLS (peers{scope})" if self.tls is not None else "")

    def register_metrics(self, registry: Any) -> None:
        """Count refused calls (``gridserve:rpc_denied_total``) in the role's Prometheus registry."""
        if registry is not None and self.authorization is not None:
            registry.register(self.authorization)

    def _publish_health(self) -> None:
        """Readiness and liveness of the server and every service it added (from any thread)."""
        ready = _SERVING if self.readiness.ready else _NOT_SERVING
        live = self.readiness.live
        self._live = live
        names = ["", *self._services]

        async def update() -> None:
            for name in names:
                await self.health.set(name, ready)
            await self.health.set(LIVENESS_SERVICE, _SERVING if live else _NOT_SERVING)

        if self.runner.in_loop():
            self.loop.create_task(update())
        elif not self._stopped.is_set():
            try:
                self.run(update(), timeout=10)
            except RuntimeError:  # the loop already stopped (shutdown raced a late change)
                pass

    async def _watch_liveness(self) -> None:
        """Re-publish health when the watchdog's verdict changes (a busy thread stopped beating)."""
        while True:
            await asyncio.sleep(WATCHDOG_POLL_S)
            if self.readiness.live != self._live:
                if not self.readiness.live:
                    logger.error("%s watchdog: no heartbeat for %.1f s: not live",
                                 self.readiness.role or "role", self.readiness.watchdog_s or 0.0)
                self._publish_health()

    def install_signal_handlers(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, _frame: self._on_signal(signum))
        if self.tls is not None:  # re-read the certificate files now (they are also watched)
            signal.signal(signal.SIGHUP, lambda _signum, _frame: self.tls.reload())

    def _on_signal(self, signum: int) -> None:
        logger.info("signal %d: draining", signum)
        threading.Thread(target=self.shutdown, name="drain", daemon=True).start()

    def shutdown(self) -> None:
        """NOT_SERVING, drain the role, stop the server and its loop (idempotent; not on the loop)."""
        with self._lock:
            if self._shutting_down:
                return
            self._shutting_down = True
        self.readiness.try_set(State.DRAINING, "shutting down")
        if self.on_drain is not None:
            try:
                self.on_drain(self.grace_s)
            except Exception:  # noqa: BLE001 - shutdown must go on
                logger.exception("drain failed")
        try:
            if self._watchdog_task is not None:
                self.call(self._watchdog_task.cancel)
            self.run(self.server.stop(self.grace_s))
            if self.health_server is not None:
                self.run(self.health_server.stop(0))
        finally:
            self.readiness.try_set(State.DEAD, "stopped")
            self.runner.stop()
            self._stopped.set()

    def wait(self) -> None:
        """Block until ``shutdown`` completed."""
        while not self._stopped.wait(0.5):
            pass
