"""Entry point of the worker role: ``gridserve worker --port PORT``.

The worker is NOT_SERVING until an engine has loaded the model and allocated the KV cache
through ``CollectiveRPC``; it stays up for that engine until SIGTERM. A worker of a tensor /
pipeline parallel group exits when its engine's stream ends (its process group cannot be reused).
The same server serves ``KVTransfer`` (disaggregated prefill / decode: other workers pull KV here).
"""

from __future__ import annotations

import logging
import os
from typing import Optional

from prometheus_client import CollectorRegistry

from gridserve.api.worker.v1 import worker_pb2, worker_pb2_grpc
from gridserve.services.worker.kv_transfer import SERVICE as KV_TRANSFER_SERVICE
from gridserve.services.worker.kv_transfer import KVTransferServicer
from gridserve.services.worker.observability import WorkerObserver
from gridserve.services.worker.servicer import WorkerServicer
from gridserve.shared.observability.metrics import start_metrics_server
from gridserve.shared.observability.tracing import Tracing
from gridserve.shared.plugins import load_general_plugins
from gridserve.shared.readiness import State
from gridserve.shared.rpc.server import RpcServer

logger = logging.getLogger(__name__)

SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name


def serve(host: str, port: int, *, metrics_port: Optional[int] = None,
          otlp_traces_endpoint: Optional[str] = None, health_port: Optional[int] = None,
          batch_invariant: bool = False) -> int:
    load_general_plugins()  # plugins register in every process (lazy strings: no torch here)
    registry = CollectorRegistry(auto_describe=False) if metrics_port is not None else None
    metrics_server = start_metrics_server(registry, host, metrics_port) if registry is not None else None
    observer = WorkerObserver(registry, Tracing.create("gridserve-worker", otlp_traces_endpoint))
    server = RpcServer(host, port, role="worker", health_port=health_port)  # the stream is async; worker methods run in the servicer's thread
    servicer = WorkerServicer(on_ready=lambda ok: server.readiness.try_set(State.READY if ok else State.DRAINING), on_orphaned=_exit, observer=observer,
                              batch_invariant=batch_invariant)
    server.register_metrics(registry)
    server.add_service(SERVICE, lambda s: worker_pb2_grpc.add_WorkerServicer_to_server(servicer, s))
    kv_transfer = KVTransferServicer(servicer.kv_connector)  # P/D: consumers' workers pull KV here
    server.add_service(KV_TRANSFER_SERVICE, lambda s: worker_pb2_grpc.add_KVTransferServicer_to_server(kv_transfer, s))
    server.install_signal_handlers()
    server.start()
    server.wait()
    observer.shutdown()
    if metrics_server is not None:
        metrics_server.stop()
    logger.info("worker stopped")
    return 0


def _exit(code: int) -> None:
    """Leave at once: a rank whose group is gone may be blocked in a collective that never returns."""
    logging.shutdown()
    os._exit(code)
