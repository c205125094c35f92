"""``EngineStatus``: what the engine's ``GetStatus`` RPC reports — each worker's health, asked now,
and the engine's cumulative token counts.

The engine is the only role that knows its workers' addresses (and, on Kubernetes, the only one
allowed to reach them), so the gateway's status endpoint asks the engine, and the engine asks each
worker's ``grpc.health.v1`` service in parallel with a short deadline. A worker that does not answer
is ``UNREACHABLE``. The report does not depend on the engine loop: it answers while the workers
still load the model and after the loop failed (a killed worker), which is when an operator needs it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gridserve.shared.load import EngineLoad
from gridserve.shared.rpc.client import make_channel

logger = logging.getLogger(__name__)

HEALTH_DEADLINE_S = 1.0
UNREACHABLE = "UNREACHABLE"


@dataclass
class WorkerHealth:
    rank: int
    address: str
    health: str


@dataclass
class EngineStatusReport:
    workers: list[WorkerHealth]
    loop_alive: bool
    error: str = ""
    stats: Optional[EngineLoad] = field(default=None)


class EngineStatus:
    """Builds ``EngineStatusReport``s; ``stats`` is the loop's snapshot (raises when it is not running)."""

    def __init__(self, worker_addresses: list[str], stats: Callable[[], EngineLoad],
                 deadline_s: float = HEALTH_DEADLINE_S) -> None:
        self.worker_addresses = list(worker_addresses)
        self.stats = stats
        self.deadline_s = deadline_s
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()

    def report(self) -> EngineStatusReport:
        workers = self.check_workers()
        try:
            stats = self.stats()
        except Exception as exc:  # noqa: BLE001 - a starting or dead loop is a status, not an error
            return EngineStatusReport(workers, loop_alive=False, error=str(exc) or type(exc).__name__)
        return EngineStatusReport(workers, loop_alive=True, stats=stats)

    def check_workers(self) -> list[WorkerHealth]:
        """Every worker's health, asked in parallel (one deadline for all)."""
        calls = []
        for address in self.worker_addresses:
            stub = health_pb2_grpc.HealthStub(self._channel(address))
            calls.append(stub.Check.future(health_pb2.HealthCheckRequest(), timeout=self.deadline_s))
        return [WorkerHealth(rank, address, _health(call))
                for rank, (address, call) in enumerate(zip(self.worker_addresses, calls))]

    def _channel(self, address: str) -> grpc.Channel:
        with self._lock:
            if address not in self._channels:
                self._channels[address] = make_channel(address)
            return self._channels[address]

    def close(self) -> None:
        with self._lock:
            for channel in self._channels.values():
                channel.close()
            self._channels.clear()


def _health(call: grpc.Future) -> str:
    try:
        response = call.result()
    except grpc.RpcError as exc:
        logger.debug("worker health check failed: %s", exc.code().name)
        return UNREACHABLE
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
