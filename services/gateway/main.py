"""Entry point of the gateway role: ``gridserve gateway --engines ADDR,... --port PORT``.

Asks the first engine for the model (tokenizer folder, limits), opens an output stream to every
engine, and serves the public ``Gateway`` API. SERVING while at least one engine stream is open;
NOT_SERVING while draining on SIGTERM (in-flight requests get ``grace_s`` to finish).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any, Optional

import grpc

from gridserve.api.engine.v1 import engine_pb2
from gridserve.api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from gridserve.services.gateway.auth import ApiKeyInterceptor
from gridserve.services.gateway.chat_options import ChatOptions
from gridserve.services.gateway.chat_template import ChatTemplateRenderer
from gridserve.services.gateway.limits import RequestLimits
from gridserve.services.gateway.load_watcher import LoadWatcher
from gridserve.services.gateway.media_loader import MediaConfig, MediaLoader
from gridserve.services.gateway.multimodal import MultiModalProcessor
from gridserve.services.gateway.observability import GatewayMetrics
from gridserve.services.gateway.pooling import ModelInfo
from gridserve.services.gateway.responses_store import ResponsesStoreOptions
from gridserve.services.gateway.service import GatewayService
from gridserve.services.gateway.servicer import GatewayServicer
from gridserve.services.gateway.status import StatusCollector
from gridserve.services.gateway.tokenizer import GatewayTokenizer
from gridserve.shared.errors import EngineDeadError
from gridserve.shared.observability.metrics import start_metrics_server
from gridserve.shared.observability.tracing import Tracing
from gridserve.shared.plugins import load_general_plugins
from gridserve.shared.readiness import Readiness, State
from gridserve.shared.rpc.engine_client import EngineClient
from gridserve.shared.rpc.server import RpcServer

logger = logging.getLogger(__name__)

SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name


def serve(engine_addresses: list[str], host: str, port: int, grace_s: float = 10.0,
          connect_timeout_s: float = 600.0, served_model_name: Optional[str] = None,
          api_key: Optional[str] = None, metrics_port: Optional[int] = None,
          otlp_traces_endpoint: Optional[str] = None, coordinator: Optional[str] = None,
          limits: Optional[RequestLimits] = None, blocking_workers: int = 8,
          media: Optional[MediaConfig] = None, health_port: Optional[int] = None,
          chat: Optional[ChatOptions] = None, responses: Optional[ResponsesStoreOptions] = None,
          routing_policy: str = "load") -> int:
    """``limits``: the per-request caps; ``blocking_workers``: the threads that tokenize and render
    chat templates off the event loop; ``media``: where images may come from, how big and slow;
    ``chat``: the tool-call and reasoning parsers of chat replies; ``responses``: whether (and
    how much) the Responses API keeps for ``previous_response_id``; ``routing_policy``: how the
    router picks an engine (``load`` or ``prefix``: cache-aware, from the engines' digests)."""
    load_general_plugins()  # plugins register in every process (lazy strings: no torch here)
    interceptors = [ApiKeyInterceptor(api_key)] if api_key else []
    # asyncio server: every RPC is ``async`` and shares its loop.
    server = RpcServer(host, port, max_workers=32, grace_s=grace_s, interceptors=interceptors, role="gateway",
                       health_port=health_port)
    gateway_id = f"gateway-{uuid.uuid4().hex[:8]}"
    # The engine clients (and the load watcher) run on the server's loop: build them there.
    engines = server.call(lambda: [EngineClient(a, gateway_id) for a in engine_addresses])
    try:
        info = server.run(engines[0].info(timeout=connect_timeout_s))
    except grpc.RpcError as exc:
        raise EngineDeadError(f"cannot reach the engine at {engine_addresses[0]}: {exc.code().name}") from None
    model_name = served_model_name or info.model
    metrics = GatewayMetrics(model_name) if metrics_port is not None else None
    tracing = Tracing.create("gridserve-gateway", otlp_traces_endpoint)
    limits = limits or RequestLimits()
    renderer = ChatTemplateRenderer(limits.max_rendered_template_chars, limits.template_render_timeout_s)
    service = GatewayService(GatewayTokenizer(info.tokenizer_path, renderer), engines, info.model,
                             info.max_model_len, info.vocab_size, info.max_logprobs, metrics, tracing,
                             limits, blocking_workers, MultiModalProcessor.from_model_folder(info.model_path),
                             MediaLoader(media), _sampling_defaults(info), chat, ModelInfo.from_engine_info(info),
                             routing_policy)
    metrics_server = None
    if metrics is not None:
        # The edge's GET /metrics shows these, with every engine's metrics merged in.
        metrics.add_engines(lambda: [(e.metrics_url(), {"engine": str(i), "model_name": model_name})
                                     for i, e in enumerate(engines)])
        metrics_server = start_metrics_server(metrics.registry, host, metrics_port)
        server.register_metrics(metrics.registry)
    for engine in engines:
        engine.on_state = lambda: _follow_engines(server.readiness, service)
    # DP > 1: route by the load every engine reports to the coordinator.
    watcher = server.call(lambda: LoadWatcher(coordinator, gateway_id, service.router)) if coordinator else None
    # Runtime LoRA loading through the REST edge needs the API key (the edge has no admin identity).
    servicer = GatewayServicer(service, served_model_name, (responses or ResponsesStoreOptions()).store(),
                               runtime_lora_updating=bool(api_key))
    servicer.status = StatusCollector(server.address, engine_addresses, coordinator, service.is_ready,
                                      lambda i: engines[i].ready.is_set())
    server.add_service(SERVICE, lambda s: gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, s))

    def drain(timeout: float) -> None:
        server.run(service.drain(timeout))
        server.run(_close([*engines, *([watcher] if watcher is not None else [])]))
        if tracing is not None:
            tracing.shutdown()

    server.on_drain = drain
    server.install_signal_handlers()
    server.start()
    _follow_engines(server.readiness, service)
    logger.info("gateway %s on %s for %s (runner %s%s)%s", gateway_id, server.address, info.model,
                service.model_info.runner,
                f": {', '.join(service.model_info.supported_tasks)}" if service.model_info.pooling else "",
                " (API key required)" if api_key else "")
    server.wait()
    if metrics_server is not None:
        metrics_server.stop()
    return 0


def _sampling_defaults(info: engine_pb2.GetInfoResponse) -> dict[str, Any]:
    """The model's sampling defaults the engine sends (only the fields its generation config sets)."""
    msg = info.default_sampling_params
    defaults = {f.name: getattr(msg, f.name) for f in msg.DESCRIPTOR.fields
                if f.has_presence and msg.HasField(f.name)}
    if defaults:
        logger.info("requests that leave a sampling field out get the model's generation config value: %s",
                    ", ".join(f"{k}={v}" for k, v in defaults.items()))
    return defaults


def _follow_engines(readiness: Readiness, service: GatewayService) -> None:
    """The gateway is READY while some engine is; RECOVERING while none is (once it was ready)."""
    if service.is_ready():
        readiness.try_set(State.READY, "an engine is ready")
    elif readiness.state is State.READY:
        readiness.set(State.RECOVERING, "no engine is ready")


async def _close(clients: list) -> None:
    """Close the engine clients and the load watcher on the server's loop, before it stops."""
    await asyncio.gather(*(client.close() for client in clients), return_exceptions=True)
