"""Entry point of the coordinator role: ``gridserve coordinator --port PORT`` (only when DP > 1).

Engines stream their load in; every gateway watches snapshots of all of them. SERVING from the
start (it holds no model); on SIGTERM the watch streams end and the server stops.
"""

from __future__ import annotations

import logging

from gridserve.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from gridserve.services.coordinator.load_table import LoadTable
from gridserve.services.coordinator.servicer import CoordinatorServicer
from gridserve.shared.rpc.server import RpcServer

logger = logging.getLogger(__name__)

SERVICE = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name


def serve(host: str, port: int, grace_s: float = 5.0) -> int:
    server = RpcServer(host, port, max_workers=256, grace_s=grace_s)
    servicer = CoordinatorServicer(LoadTable())
    server.add_service(SERVICE, lambda s: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, s))
    server.on_drain = lambda timeout: servicer.stopping.set()
    server.install_signal_handlers()
    server.start()
    server.set_serving(True)
    logger.info("coordinator on %s", server.address)
    server.wait()
    return 0
