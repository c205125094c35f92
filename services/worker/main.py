"""Entry point of the worker role: ``gridserve worker --port PORT``.

The worker is NOT_SERVING until an engine has loaded the model and allocated the KV cache
through ``CollectiveRPC``; it stays up for that engine until SIGTERM.
"""

from __future__ import annotations

import logging

from gridserve.services.worker.servicer import WorkerServicer
from gridserve.shared.rpc.server import RpcServer
from gridserve.worker.v1 import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)

SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name


def serve(host: str, port: int) -> int:
    server = RpcServer(host, port, max_workers=8)
    servicer = WorkerServicer(on_ready=server.set_serving)
    server.add_service(SERVICE, lambda s: worker_pb2_grpc.add_WorkerServicer_to_server(servicer, s))
    server.install_signal_handlers()
    server.start()
    server.wait()
    logger.info("worker stopped")
    return 0
