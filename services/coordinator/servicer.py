"""The coordinator's gRPC servicer: ``ReportLoad`` (engines, client stream) and ``WatchLoad``
(gateways, server stream); protobuf <-> ``LoadTable`` only."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator

import grpc

from gridserve.api.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from gridserve.services.coordinator.load_table import EngineLoad, LoadTable
from gridserve.services.coordinator.waves import WaveError, Waves

logger = logging.getLogger(__name__)

# A snapshot goes out at once when something changed, and at least this often otherwise.
PUBLISH_INTERVAL_S = float(os.environ.get("GRIDSERVE_COORDINATOR_PUBLISH_INTERVAL_S", "1.0"))


def load_to_pb(load: EngineLoad) -> coordinator_pb2.EngineLoad:
    return coordinator_pb2.EngineLoad(dp_rank=load.dp_rank, address=load.address, num_waiting=load.num_waiting,
                                      num_running=load.num_running, kv_cache_usage=load.kv_cache_usage)


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, table: LoadTable, waves: Waves) -> None:
        self.table = table
        self.waves = waves
        self.stopping = threading.Event()

    def ReportLoad(self, request_iterator: Iterator[coordinator_pb2.ReportLoadRequest],
                   context: grpc.ServicerContext) -> coordinator_pb2.ReportLoadResponse:
        rank = None
        try:
            for request in _until_closed(request_iterator):
                load = request.load
                if rank is None:
                    logger.info("engine %d (%s) reports its load", load.dp_rank, load.address)
                rank = load.dp_rank
                self.table.update(EngineLoad(load.dp_rank, load.address, load.num_waiting, load.num_running,
                                             load.kv_cache_usage, time.monotonic()))
        finally:
            if rank is not None:
                logger.info("engine %d stopped reporting: removed", rank)
                self.table.remove(rank)
        return coordinator_pb2.ReportLoadResponse()

    def WatchLoad(self, request: coordinator_pb2.WatchLoadRequest,
                  context: grpc.ServicerContext) -> Iterator[coordinator_pb2.WatchLoadResponse]:
        logger.info("gateway %s watches the load", request.gateway_id or "?")
        version = -1
        while context.is_active() and not self.stopping.is_set():
            version, loads = self.table.wait_for_change(version, PUBLISH_INTERVAL_S)
            wave, running = self.waves.state()
            yield coordinator_pb2.WatchLoadResponse(engines=[load_to_pb(x) for x in loads], wave=wave,
                                                    wave_running=running)

    def StartWave(self, request: coordinator_pb2.StartWaveRequest,
                  context: grpc.ServicerContext) -> coordinator_pb2.StartWaveResponse:
        wave = self.waves.start()
        logger.debug("engine %d starts wave %d", request.dp_rank, wave)
        return coordinator_pb2.StartWaveResponse(wave=wave)

    def SyncStep(self, request: coordinator_pb2.SyncStepRequest,
                 context: grpc.ServicerContext) -> coordinator_pb2.SyncStepResponse:
        try:
            any_unfinished = self.waves.sync(request.dp_rank, request.wave, request.step, request.unfinished)
        except WaveError as exc:
            context.abort(grpc.StatusCode.ABORTED, str(exc))
        return coordinator_pb2.SyncStepResponse(any_unfinished=any_unfinished)


def _until_closed(requests: Iterator) -> Iterator:
    """The client's stream until it ends or the engine goes away (a cancelled stream, not an error)."""
    try:
        yield from requests
    except grpc.RpcError:
        return
