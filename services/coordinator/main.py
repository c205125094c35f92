"""Entry point of the coordinator role: ``gridserve coordinator --port PORT`` (only when DP > 1).

Engines stream their load in; every gateway watches snapshots of all of them. SERVING from the
start (it holds no model); on SIGTERM the watch streams end and the server stops.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily

from gridserve.api.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from gridserve.services.coordinator.load_table import LoadTable
from gridserve.services.coordinator.servicer import CoordinatorServicer
from gridserve.services.coordinator.waves import Waves
from gridserve.shared.observability.metrics import start_metrics_server
from gridserve.shared.plugins import load_general_plugins
from gridserve.shared.readiness import State
from gridserve.shared.rpc.server import RpcServer

logger = logging.getLogger(__name__)

SERVICE = coordinator_pb2.DESCRIPTOR.services_by_name["Coordinator"].full_name


class _LoadAge:
    """``gridserve:coordinator_load_age_seconds{engine}``: seconds since each engine last reported."""

    def __init__(self, table: LoadTable) -> None:
        self.table = table

    def collect(self):
        age = GaugeMetricFamily("gridserve:coordinator_load_age_seconds",
                                "Seconds since the engine's last load report", labels=["engine"])
        now = time.monotonic()
        for entry in self.table.snapshot()[1]:
            age.add_metric([str(entry.dp_rank)], now - entry.reported_at)
        yield age


def serve(host: str, port: int, grace_s: float = 5.0, metrics_port: Optional[int] = None,
          data_parallel_size: int = 1, health_port: Optional[int] = None) -> int:
    load_general_plugins()  # plugins register in every process (lazy strings: no torch here)
    server = RpcServer(host, port, grace_s=grace_s, role="coordinator", health_port=health_port)  # every handler is async: one loop
    table = LoadTable()
    servicer = CoordinatorServicer(table, Waves(data_parallel_size, on_change=table.bump))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_LoadAge(table))
    metrics_server = start_metrics_server(registry, host, metrics_port)
    server.register_metrics(registry)
    server.add_service(SERVICE, lambda s: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, s))
    server.on_drain = lambda timeout: servicer.stopping.set()
    server.install_signal_handlers()
    server.start()
    server.readiness.set(State.READY)
    logger.info("coordinator on %s", server.address)
    server.wait()
    if metrics_server is not None:
        metrics_server.stop()
    return 0
