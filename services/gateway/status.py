"""``StatusCollector``: the gateway's ``GET /v1/status`` — every role's health and every engine's load.

One snapshot asks, in parallel and with one short deadline, each engine for its ``grpc.health.v1``
status, its load (``GetLoad``: queues, KV-cache use, prefix-cache hit rate) and its own status (``GetStatus``: its workers' health, asked by the
engine, which alone knows and may reach them; its cumulative token counts; with disaggregated
prefill / decode its ``kv_role`` and KV transfer counters), and the coordinator for
its health. The gateway reports itself from its own state. A snapshot serves every caller for
``cache_s`` (1 s) after it was taken, and callers that ask while one is being taken share it: however
many poll ``/v1/status`` (the endpoint needs no key), the deployment sees at most one fan-out per
second from each gateway. Besides that only each engine's token count is kept, from which the token
rate is derived: the engines report counters, the collector turns them into tokens per second over
the last few seconds of snapshots.

Health is a ``grpc.health.v1`` status name (``SERVING``, ``NOT_SERVING``, ...) or ``UNREACHABLE``
when the role did not answer (an engine that does not answer lists no workers). Readiness is "can take work now" (see ``RoleStatus.ready`` in gateway.proto).
The collector runs on the gateway's asyncio loop and uses ``grpc.aio`` channels it opens lazily.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gridserve.api.engine.v1 import engine_pb2, engine_pb2_grpc
from gridserve.api.gateway.v1 import gateway_pb2
from gridserve.shared.rpc.client import aio_channel

logger = logging.getLogger(__name__)

DEADLINE_S = 2.0
CACHE_S = 1.0
RATE_WINDOW_S = 5.0
SERVING, NOT_SERVING, UNREACHABLE = "SERVING", "NOT_SERVING", "UNREACHABLE"


@dataclass
class RoleState:
    role: str
    name: str
    address: str
    health: str
    ready: bool
    detail: str = ""


@dataclass
class EngineState:
    name: str
    address: str
    num_waiting: int = 0
    num_running: int = 0
    kv_cache_usage: float = 0.0
    generation_tokens_per_second: float = 0.0
    num_workers: int = 0
    sleeping: bool = False
    # One dict per KV cache group, in group index order: name (full, sliding_window_<window>, ...;
    # not unique), num_blocks (blocks it holds now), usage (num_blocks / the pool's blocks).
    kv_cache_groups: list[dict] = field(default_factory=list)
    # Prompt tokens looked up in its prefix cache since it started, those found, and their ratio.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_hit_rate: float = 0.0
    # Disaggregated prefill / decode: its kv_role ("" for a plain engine) and KV transfer counters
    # (a common.v1.KVTransferCounters; None without a kv_role).
    kv_role: str = ""
    kv_transfers: Optional[Any] = None


@dataclass
class Snapshot:
    roles: list[RoleState]
    engines: list[EngineState]
    time: float


class TokenRate:
    """Tokens per second from a cumulative counter sampled at irregular times: the rate over the
    samples of the last ``window_s`` seconds (0 until there are two; a counter that went down —
    a restarted engine — starts over)."""

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, int]] = deque()

    def update(self, now: float, count: int) -> float:
        if self._samples and count < self._samples[-1][1]:
            self._samples.clear()
        self._samples.append((now, count))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window_s:
            self._samples.popleft()
        start, first = self._samples[0]
        return (count - first) / (now - start) if now > start else 0.0


class StatusCollector:
    """Gathers a ``Snapshot`` of the deployment; ``gateway_ready`` is the gateway's own readiness and
    ``engine_ready(i)`` whether its output stream to engine ``i`` is open."""

    def __init__(self, address: str, engine_addresses: list[str], coordinator: Optional[str],
                 gateway_ready: Callable[[], bool], engine_ready: Callable[[int], bool],
                 deadline_s: float = DEADLINE_S, cache_s: float = CACHE_S) -> None:
        self.address = address
        self.engine_addresses = list(engine_addresses)
        self.coordinator = coordinator
        self.gateway_ready = gateway_ready
        self.engine_ready = engine_ready
        self.deadline_s = deadline_s
        self.cache_s = cache_s
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._rates = [TokenRate() for _ in engine_addresses]
        self._latest: Optional[tuple[float, Snapshot]] = None  # (time.monotonic() taken, snapshot)
        self._taking: Optional[asyncio.Future] = None  # the fan-out in progress, shared

    async def snapshot(self) -> Snapshot:
        """The latest snapshot if younger than ``cache_s``; else the one being taken (one fan-out for
        every caller; a caller that goes away does not cancel it for the others)."""
        if self._latest is not None and time.monotonic() - self._latest[0] < self.cache_s:
            return self._latest[1]
        if self._taking is None:
            self._taking = asyncio.ensure_future(self._take())
        return await asyncio.shield(self._taking)

    async def _take(self) -> Snapshot:
        try:
            snapshot = await self._collect()
            self._latest = (time.monotonic(), snapshot)
            return snapshot
        finally:
            self._taking = None

    async def _collect(self) -> Snapshot:
        ready = self.gateway_ready()
        roles = [RoleState("gateway", "gateway", self.address, SERVING if ready else NOT_SERVING, ready,
                           "" if ready else "no engine output stream is open, or draining")]
        if self.coordinator:
            health = await self._health(self.coordinator)
            roles.append(RoleState("coordinator", "coordinator", self.coordinator, health, health == SERVING,
                                   _detail(health)))
        engines = []
        results = await asyncio.gather(*(self._engine(i, a) for i, a in enumerate(self.engine_addresses)))
        for engine_roles, engine in results:
            roles += engine_roles
            engines.append(engine)
        return Snapshot(roles, engines, time.time())

    async def _engine(self, index: int, address: str) -> tuple[list[RoleState], EngineState]:
        name = f"engine-{index}"
        stub = engine_pb2_grpc.EngineCoreStub(self._channel(address))
        health, load, status = await asyncio.gather(
            self._health(address),
            self._call(stub.GetLoad, engine_pb2.GetLoadRequest()),
            self._call(stub.GetStatus, engine_pb2.GetStatusRequest()),
        )
        engine = EngineState(name, address)
        if load is not None:
            engine.num_waiting, engine.num_running = load.num_waiting, load.num_running
            engine.kv_cache_usage, engine.sleeping = load.kv_cache_usage, load.sleeping
            engine.kv_cache_groups = [{"name": g.name, "num_blocks": g.num_blocks, "usage": g.usage}
                                      for g in load.kv_cache_groups]
            engine.prefix_cache_queries, engine.prefix_cache_hits = load.prefix_cache_queries, load.prefix_cache_hits
            if load.prefix_cache_queries:
                engine.prefix_cache_hit_rate = load.prefix_cache_hits / load.prefix_cache_queries
            if load.HasField("kv_transfers"):
                engine.kv_transfers = load.kv_transfers
                engine.kv_role = load.kv_transfers.kv_role
        detail = _detail(health)
        if status is None:
            alive = False
            detail = detail or "GetStatus failed"
        else:
            alive = status.loop_alive
            detail = status.error or detail  # the loop's own error says more than its health
            engine.num_workers = len(status.workers)
            if alive:
                engine.generation_tokens_per_second = self._rates[index].update(time.monotonic(),
                                                                                status.num_generation_tokens)
        stream_open = self.engine_ready(index)
        ready = health == SERVING and alive and stream_open
        if not detail and not stream_open:
            detail = "this gateway's output stream to it is not open"
        roles = [RoleState("engine", name, address, health, ready, detail)]
        roles += _workers(index, status)
        return roles, engine

    def _channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = aio_channel(address)
        return self._channels[address]

    async def _health(self, address: str) -> str:
        stub = health_pb2_grpc.HealthStub(self._channel(address))
        response = await self._call(stub.Check, health_pb2.HealthCheckRequest())
        if response is None:
            return UNREACHABLE
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    async def _call(self, method: Any, request: Any) -> Optional[Any]:
        """``method(request)`` within the deadline; None when it fails (the failure is the status)."""
        try:
            return await method(request, timeout=self.deadline_s)
        except grpc.aio.AioRpcError as exc:
            logger.debug("status call failed: %s %s", exc.code().name, exc.details())
            return None

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()


def _workers(index: int, status: Optional[engine_pb2.GetStatusResponse]) -> list[RoleState]:
    if status is None:
        return []
    return [RoleState("worker", f"worker-{index}.{w.rank}", w.address, w.health, w.health == SERVING,
                      _detail(w.health)) for w in status.workers]


def _detail(health: str) -> str:
    if health == SERVING:
        return ""
    if health == UNREACHABLE:
        return "did not answer its health check"
    return f"health check says {health}"


def snapshot_to_pb(snapshot: Snapshot) -> gateway_pb2.GetStatusResponse:
    return gateway_pb2.GetStatusResponse(
        roles=[gateway_pb2.RoleStatus(role=r.role, name=r.name, address=r.address, health=r.health,
                                      ready=r.ready, detail=r.detail) for r in snapshot.roles],
        engines=[gateway_pb2.EngineStatus(**vars(e)) for e in snapshot.engines],
        time=snapshot.time,
    )

