"""``EngineStatus``: what the engine's ``GetStatus`` RPC reports — each worker's health, asked now,
and the engine's cumulative token counts.

The engine is the only role that knows its workers' addresses (and, on Kubernetes, the only one
allowed to reach them), so the gateway's status endpoint asks the engine, and the engine asks each
worker's ``grpc.health.v1`` service in parallel with a short deadline. A worker that does not answer
is ``UNREACHABLE``. The report does not depend on the engine loop: it answers while the workers
still load the model and after the loop failed (a killed worker), which is when an operator needs it.
Everything runs on the engine server's event loop (``grpc.aio`` health calls, the loop's snapshot
awaited as a future); nothing blocks a thread.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Optional

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gridserve.shared.load import EngineLoad
from gridserve.shared.rpc.client import aio_channel

logger = logging.getLogger(__name__)

HEALTH_DEADLINE_S = 1.0
STATS_TIMEOUT_S = 5.0
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
    """Builds ``EngineStatusReport``s on the event loop; ``stats`` starts the loop's snapshot (it
    raises, or its future fails, when the loop is not running)."""

    def __init__(self, worker_addresses: list[str], stats: Callable[[], Future],
                 deadline_s: float = HEALTH_DEADLINE_S) -> None:
        self.worker_addresses = list(worker_addresses)
        self.stats = stats
        self.deadline_s = deadline_s
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def report(self) -> EngineStatusReport:
        workers = await self.check_workers()
        try:
            stats = await asyncio.wait_for(asyncio.wrap_future(self.stats()), STATS_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - a starting or dead loop is a status, not an error
            return EngineStatusReport(workers, loop_alive=False, error=str(exc) or type(exc).__name__)
        return EngineStatusReport(workers, loop_alive=True, stats=stats)

    async def check_workers(self) -> list[WorkerHealth]:
        """Every worker's health, asked in parallel (one deadline for all)."""
        calls = [self._check(address) for address in self.worker_addresses]
        states = await asyncio.gather(*calls)
        return [WorkerHealth(rank, address, state)
                for rank, (address, state) in enumerate(zip(self.worker_addresses, states))]

    async def _check(self, address: str) -> str:
        if address not in self._channels:
            self._channels[address] = aio_channel(address)
        stub = health_pb2_grpc.HealthStub(self._channels[address])
        try:
            response = await stub.Check(health_pb2.HealthCheckRequest(), timeout=self.deadline_s)
        except grpc.RpcError as exc:
            logger.debug("worker %s health check failed: %s", address, exc.code().name)
            return UNREACHABLE
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        await asyncio.gather(*(channel.close() for channel in channels))
