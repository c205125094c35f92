"""Entry point of the engine role: ``gridserve engine --workers ADDR,... --model MODEL``.

Connects to its worker services (GrpcExecutor), sizes and allocates the KV cache, starts the busy
loop and serves ``EngineCore``. SERVING once the workers hold the model and the cache; NOT_SERVING
when a worker dies or while draining on SIGTERM.
"""

from __future__ import annotations

import logging

from gridserve.engine.v1 import engine_pb2, engine_pb2_grpc
from gridserve.services.engine.core import EngineCore
from gridserve.services.engine.loop import EngineLoop
from gridserve.services.engine.servicer import EngineServicer
from gridserve.shared.config import GridserveConfig
from gridserve.shared.rpc.server import RpcServer

logger = logging.getLogger(__name__)

SERVICE = engine_pb2.DESCRIPTOR.services_by_name["EngineCore"].full_name


def serve(config: GridserveConfig, host: str, port: int, grace_s: float = 10.0) -> int:
    """Run the engine until SIGTERM; ``config`` must name its workers (executor ``grpc``)."""
    server = RpcServer(host, port, max_workers=64, grace_s=grace_s)
    servicer = EngineServicer(config)
    server.add_service(SERVICE, lambda s: engine_pb2_grpc.add_EngineCoreServicer_to_server(servicer, s))
    server.install_signal_handlers()
    server.start()  # answers health (NOT_SERVING) while the workers load
    core = EngineCore(config)
    loop = EngineLoop(core, on_health=server.set_serving)
    core.executor.on_failure = loop.fail
    servicer.loop = loop

    def drain(timeout: float) -> None:
        loop.drain(timeout)
        core.shutdown()

    server.on_drain = drain
    server.set_serving(True)
    logger.info("engine ready on %s: %d KV blocks", server.address, config.cache.num_blocks or 0)
    server.wait()
    return 0
