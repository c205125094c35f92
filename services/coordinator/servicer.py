"""The coordinator's gRPC servicer: ``ReportLoad`` (engines, client stream), ``WatchLoad``
(gateways and MoE engines, server stream) and the wave calls; protobuf <-> ``LoadTable`` /
``Waves`` only. Every handler is ``async``: the whole coordinator is one event loop. A report
stream keeps the rank it started with, and with a certificate per instance (``engine-<rank>``,
``shared.rpc.authz``) an engine speaks only for its own rank. Each watch stream keeps the version
of every engine's prefix-cache digest it sent, and sends each engine's changes since (the whole
digest first)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import AsyncIterator
from typing import Optional

import grpc

from gridserve.api.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from gridserve.services.coordinator.load_table import Entry, LoadTable
from gridserve.services.coordinator.waves import WaveError, Waves
from gridserve.shared import envs
from gridserve.shared.errors import InvalidArgumentError
from gridserve.shared.load import EngineLoad
from gridserve.shared.prefix_digest import Cursor, DigestUpdate
from gridserve.shared.rpc.authz import check_rank
from gridserve.shared.rpc.digest_convert import digest_from_pb, digest_to_pb

logger = logging.getLogger(__name__)


def entry_to_pb(entry: Entry, digest: Optional[DigestUpdate] = None) -> coordinator_pb2.EngineLoad:
    load = entry.load
    msg = coordinator_pb2.EngineLoad(dp_rank=entry.dp_rank, address=entry.address, num_waiting=load.num_waiting,
                                     num_running=load.num_running, kv_cache_usage=load.kv_cache_usage)
    if digest is not None:
        msg.prefix_digest.CopyFrom(digest_to_pb(digest))
    return msg


def entry_from_pb(msg: coordinator_pb2.EngineLoad, reported_at: float) -> Entry:
    load = EngineLoad(msg.num_waiting, msg.num_running, msg.kv_cache_usage)
    return Entry(msg.dp_rank, msg.address, load, reported_at)


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, table: LoadTable, waves: Waves) -> None:
        self.table = table
        self.waves = waves
        self.stopping = threading.Event()  # set by the drain (another thread): watch streams end

    async def ReportLoad(self, request_iterator: AsyncIterator[coordinator_pb2.ReportLoadRequest],
                         context: grpc.aio.ServicerContext) -> coordinator_pb2.ReportLoadResponse:
        rank = None
        try:
            async for request in request_iterator:
                if rank is None:
                    check_rank(context, request.load.dp_rank)  # a certificate per instance: its own rank
                    logger.info("engine %d (%s) reports its load", request.load.dp_rank, request.load.address)
                    rank = request.load.dp_rank
                elif request.load.dp_rank != rank:
                    raise InvalidArgumentError("load.dp_rank", f"changed from {rank} to {request.load.dp_rank} "
                                                               "within one report stream")
                self.table.update(entry_from_pb(request.load, time.monotonic()), digest_from_pb(request.load))
        except grpc.RpcError:
            pass  # the engine went away: a cancelled stream, not an error
        finally:
            if rank is not None:
                logger.info("engine %d stopped reporting: removed", rank)
                self.table.remove(rank)
        return coordinator_pb2.ReportLoadResponse()

    async def WatchLoad(self, request: coordinator_pb2.WatchLoadRequest,
                        context: grpc.aio.ServicerContext) -> AsyncIterator[coordinator_pb2.WatchLoadResponse]:
        logger.info("%s watches the load", request.subscriber_id or "?")
        version = -1
        cursors: dict[int, Cursor] = {}  # the version of each engine's digest this watcher has
        while not self.stopping.is_set():
            version, entries = await self.table.wait_for_change(
                version, envs.GRIDSERVE_COORDINATOR_PUBLISH_INTERVAL_S)  # at least this often
            wave, running = self.waves.state()
            engines = []
            for entry in entries:
                digest = self.table.digest_since(entry.dp_rank, cursors.get(entry.dp_rank))
                if digest is not None:
                    cursors[entry.dp_rank] = digest.cursor
                engines.append(entry_to_pb(entry, digest))
            yield coordinator_pb2.WatchLoadResponse(engines=engines, wave=wave, wave_running=running)

    async def StartWave(self, request: coordinator_pb2.StartWaveRequest,
                        context: grpc.aio.ServicerContext) -> coordinator_pb2.StartWaveResponse:
        check_rank(context, request.dp_rank)
        wave = self.waves.start()
        logger.debug("engine %d starts wave %d", request.dp_rank, wave)
        return coordinator_pb2.StartWaveResponse(wave=wave)

    async def SyncStep(self, request: coordinator_pb2.SyncStepRequest,
                       context: grpc.aio.ServicerContext) -> coordinator_pb2.SyncStepResponse:
        check_rank(context, request.dp_rank)
        try:
            any_unfinished = await self.waves.sync(request.dp_rank, request.wave, request.step,
                                                   request.unfinished)
        except WaveError as exc:
            await context.abort(grpc.StatusCode.ABORTED, str(exc))
        return coordinator_pb2.SyncStepResponse(any_unfinished=any_unfinished)
