"""``EngineClient``: one gateway's connection to one engine, on ``grpc.aio``; it implements
``EngineClientProtocol`` (``shared/engine_client_protocol.py``), as the in-process
``LocalEngineClient`` does.

A ``ReconnectingStream`` keeps the engine's ``StreamOutputs`` open on the gateway's event loop and
hands each request's outputs to the sink its caller registered (``put_nowait``: an ``asyncio.Queue``
read on the loop, or a ``queue.SimpleQueue`` read by a thread). When the stream fails, every
registered request gets an ``EngineLostError`` naming the engine and the request (the gateway fails
the request over to another engine, or ends it with UNAVAILABLE) and the engine counts as not ready
until the stream is open again. A second stream watches the engine's readiness
(``grpc.health.v1`` ``Watch`` of service ``""``): ``serving`` is False while the engine is not READY
(sleeping, loading, draining, recovering, dead), and the router sends it nothing new while another
engine is READY; ``recovering`` tells the one case that still takes requests (it queues them while
its workers are rebuilt, so a gateway whose engines only recover stays ready). An add the
engine refuses because its waiting queue is full raises ``ResourceExhaustedError``; one larger than
the gRPC message limit (big images) raises ``InvalidArgumentError`` before it is sent. Every unary call
has a deadline. The adapter table's RPCs (``load_lora_adapter``, ``unload_lora_adapter``,
``list_lora_adapters``) raise the engine's refusal as its ``grpc.aio.AioRpcError``; a request on an
adapter names it (``lora_name``), the engine resolves the rest. Create it on the loop
it runs on; ``register`` / ``unregister`` / ``ready`` / ``num_in_flight`` are safe from any thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Optional

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gridserve.api.common.v1 import common_pb2
from gridserve.api.engine.v1 import engine_pb2, engine_pb2_grpc
from gridserve.shared.engine_client_protocol import EngineClientProtocol, OutputSink
from gridserve.shared.errors import EngineDeadError, InvalidArgumentError, ResourceExhaustedError
from gridserve.shared.kv_transfer import KVLayout, KVTransferParams
from gridserve.shared.multimodal import ImageFeature
from gridserve.shared.observability.tracing import TRACEPARENT
from gridserve.shared.pooling import PoolingParams
from gridserve.shared.readiness import State
from gridserve.shared.rpc import client as rpc_client
from gridserve.shared.rpc.client import DEFAULT_DEADLINE_S, aio_channel
from gridserve.shared.rpc.convert import (
    engine_output_from_pb,
    image_features_to_pb,
    pooling_params_to_pb,
    sampling_params_to_pb,
)
from gridserve.shared.rpc.kv_convert import kv_layout_from_pb, kv_params_to_pb
from gridserve.shared.rpc.reconnect import ReconnectingStream
from gridserve.shared.sampling_params import SamplingParams

__all__ = ["EngineClient", "EngineLostError"]

logger = logging.getLogger(__name__)

ABORT_DEADLINE_S = 5.0
INFO_DEADLINE_S = 2.0
STATE_DEADLINE_S = 2.0
LIST_LORA_DEADLINE_S = 5.0
# Loading an adapter reads its files on every worker of the engine.
LOAD_LORA_DEADLINE_S = 120.0


def _check_size(message: engine_pb2.AddRequestRequest) -> None:
    """A request over the channel's message limit is the caller's error (INVALID_ARGUMENT naming
    what made it big), found here: gRPC would refuse it as RESOURCE_EXHAUSTED, a 429 that tells
    the client to send the same thing again later."""
    limit = dict(rpc_client.CHANNEL_OPTIONS)["grpc.max_send_message_length"]
    size = message.ByteSize()
    if size <= limit:
        return
    images = sum(len(f.pixel_values.data) for f in message.mm_features)
    if images:
        raise InvalidArgumentError("mm_features", f"{len(message.mm_features)} images of {images} bytes of pixels "
                                                  f"make the request {size} bytes, over the {limit}-byte limit of "
                                                  "a request to an engine: send fewer or smaller images")
    raise InvalidArgumentError("prompt_token_ids", f"the request is {size} bytes, over the {limit}-byte limit of a "
                                                   "request to an engine")


class EngineLostError(EngineDeadError):
    """The output stream of ``engine`` broke while ``request_id`` was registered on it;
    ``session``: which of the engine's streams (``EngineClient.sessions`` when it opened) broke."""

    def __init__(self, message: str, engine: EngineClientProtocol, request_id: str, session: int) -> None:
        super().__init__(message)
        self.engine = engine
        self.request_id = request_id
        self.session = session


class EngineClient:
    """Data-plane client of one engine, shared by all of a gateway's requests (an
    ``EngineClientProtocol``; ``info`` and ``metrics_url`` are the remote engine's own)."""

    def __init__(self, address: str, gateway_id: str, on_state: Callable[[], None] = lambda: None) -> None:
        self.address = address
        self.gateway_id = gateway_id
        self.on_state = on_state  # the stream opened or broke (runs on the loop)
        self.loop = asyncio.get_running_loop()
        self.channel = aio_channel(address)
        self.stub = engine_pb2_grpc.EngineCoreStub(self.channel)
        self.ready = threading.Event()
        self._sinks: dict[str, OutputSink] = {}  # one dict operation at a time: safe across threads
        self._metrics_port: Optional[int] = None
        self.kv_role = ""  # disaggregated prefill / decode: the engine's --kv-role (from GetInfo)
        self.kv_layout: Optional[KVLayout] = None  # ... and what a P/D partner must share (GetInfo)
        self.sessions = 0  # output streams opened so far (a request added now rides on this one)
        self._stream = ReconnectingStream(f"engine-{address}", self._session, self._lost)
        self.serving = True  # the engine's readiness, as its health service last said
        self.recovering = False  # not ready because it rebuilds its workers: adds queue there meanwhile
        self._health = ReconnectingStream(f"engine-health-{address}", self._watch_health, self._health_lost)

    async def info(self, timeout: float = DEFAULT_DEADLINE_S) -> engine_pb2.GetInfoResponse:
        return await self.stub.GetInfo(engine_pb2.GetInfoRequest(), timeout=timeout, wait_for_ready=True)

    def register(self, request_id: str, outputs: OutputSink) -> None:
        """Deliver ``request_id``'s ``EngineCoreOutput``s (or an exception) to ``outputs``."""
        self._sinks[request_id] = outputs

    def unregister(self, request_id: str) -> None:
        self._sinks.pop(request_id, None)

    @property
    def num_in_flight(self) -> int:
        """This gateway's engine requests on this engine now (registered, not yet finished)."""
        return len(self._sinks)

    async def add_request(self, request_id: str, token_ids: list[int], params: Optional[SamplingParams],
                          parent_request_id: str = "", traceparent: str = "",
                          mm_features: Optional[list[ImageFeature]] = None,
                          output_token_ids: Optional[list[int]] = None, continuation: bool = False,
                          lora_name: Optional[str] = None, pooling_params: Optional[PoolingParams] = None,
                          token_type_ids: Optional[list[int]] = None, priority: int = 0,
                          kv_transfer_params: Optional[KVTransferParams] = None, prefill_only: bool = False,
                          cache_salt: Optional[str] = None) -> None:
        """``parent_request_id``: the id the client sees; ``traceparent``: the gateway span (W3C),
        sent as gRPC metadata; ``mm_features``: the prompt's preprocessed images; ``continuation``:
        a failover from a dead engine, which had already generated ``output_token_ids``;
        ``lora_name``: the LoRA adapter it runs on (None: the base model; an unknown one is NOT_FOUND);
        ``pooling_params`` (with ``params`` None): a pooling request, ``token_type_ids`` its segment ids;
        ``priority``: its rank under the engine's priority scheduling (lower first). Disaggregated
        prefill / decode: ``prefill_only`` asks a kv_producer to run the prompt and hold its KV;
        ``kv_transfer_params`` (a producer's, with its first token as ``output_token_ids``) has a
        kv_consumer pull that KV instead of computing the prompt. ``cache_salt``: only requests with
        the same salt share prefix-cache blocks."""
        if not self.ready.is_set():
            raise EngineDeadError(f"engine {self.address} is not reachable")
        message = engine_pb2.AddRequestRequest(
            request_id=request_id,
            gateway_id=self.gateway_id,
            prompt_token_ids=token_ids,
            sampling_params=sampling_params_to_pb(params) if params is not None else None,
            pooling_params=pooling_params_to_pb(pooling_params) if pooling_params is not None else None,
            token_type_ids=token_type_ids or [],
            parent_request_id=parent_request_id or None,
            mm_features=image_features_to_pb(mm_features or []),
            output_token_ids=output_token_ids or [],
            continuation=continuation,
            lora_request=common_pb2.LoraRequest(lora_name=lora_name) if lora_name else None,
            priority=priority,
            cache_salt=cache_salt,
        )
        if kv_transfer_params is not None:
            message.kv_transfer_params.CopyFrom(kv_params_to_pb(kv_transfer_params))
        elif prefill_only:  # present but without a transfer id: prefill only
            message.kv_transfer_params.SetInParent()
        _check_size(message)
        try:
            await self.stub.AddRequest(
                message,
                timeout=DEFAULT_DEADLINE_S,
                metadata=((TRACEPARENT, traceparent),) if traceparent else None,
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:  # its waiting queue is full
                raise ResourceExhaustedError(f"engine {self.address}: {exc.details()}") from None
            raise

    async def abort(self, request_ids: list[str]) -> None:
        """Best effort: a failure is logged (the engine may be gone)."""
        try:
            await self.stub.AbortRequests(engine_pb2.AbortRequestsRequest(request_ids=request_ids),
                                          timeout=ABORT_DEADLINE_S)
        except grpc.RpcError as exc:
            logger.info("abort %s on %s failed: %s", request_ids, self.address, exc.code().name)

    # ---- the adapter table (multi-LoRA) ----------------------------------------------------------
    async def list_lora_adapters(self) -> engine_pb2.ListLoraAdaptersResponse:
        return await self.stub.ListLoraAdapters(engine_pb2.ListLoraAdaptersRequest(), timeout=LIST_LORA_DEADLINE_S)

    async def load_lora_adapter(self, lora_name: str, lora_path: str) -> engine_pb2.LoraAdapter:
        request = engine_pb2.LoadLoraAdapterRequest(lora_name=lora_name, lora_path=lora_path)
        return (await self.stub.LoadLoraAdapter(request, timeout=LOAD_LORA_DEADLINE_S)).adapter

    async def unload_lora_adapter(self, lora_name: str) -> None:
        await self.stub.UnloadLoraAdapter(engine_pb2.UnloadLoraAdapterRequest(lora_name=lora_name),
                                          timeout=LOAD_LORA_DEADLINE_S)

    def metrics_url(self) -> Optional[str]:
        """The engine's ``/metrics`` URL (from ``GetInfo`` when the stream opened), or None."""
        if not self._metrics_port:
            return None
        host = self.address.rpartition(":")[0]
        return f"http://{host}:{self._metrics_port}/metrics"

    async def close(self) -> None:
        """Stop both streams and close the channel."""
        await self._health.close()
        await self._stream.close()
        await self.channel.close()

    async def _session(self) -> None:
        call = self.stub.StreamOutputs(engine_pb2.StreamOutputsRequest(gateway_id=self.gateway_id),
                                       wait_for_ready=True)
        async for batch in call:
            if not self.ready.is_set():
                await self._opened()
            for msg in batch.outputs:
                outputs = self._sinks.get(msg.request_id)
                if outputs is not None:
                    outputs.put_nowait(engine_output_from_pb(msg))

    async def _opened(self) -> None:
        if self._metrics_port is None:
            try:
                info = await self.info(timeout=INFO_DEADLINE_S)
                self._metrics_port, self.kv_role = info.metrics_port, info.kv_role
                self.kv_layout = kv_layout_from_pb(info)
            except grpc.RpcError as exc:
                logger.info("engine %s: no GetInfo (%s)", self.address, exc.code().name)
        self.sessions += 1
        self.ready.set()
        self.on_state()

    async def _watch_health(self) -> Optional[bool]:
        stub = health_pb2_grpc.HealthStub(self.channel)
        try:
            async for response in stub.Watch(health_pb2.HealthCheckRequest(service=""), wait_for_ready=True):
                serving = response.status == health_pb2.HealthCheckResponse.SERVING
                if serving != self.serving:
                    recovering = not serving and await self._state() == State.RECOVERING.value
                    self.serving, self.recovering = serving, recovering  # together: no window between
                    logger.info("engine %s %s", self.address,
                                "ready" if serving else "recovering" if self.recovering else "not ready")
                    self.on_state()
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                return False  # no health service: its output stream alone says whether it serves
            raise
        return True

    async def _state(self) -> str:
        """The engine's readiness state by name ("" when it cannot say within a short deadline)."""
        try:
            return (await self.stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=STATE_DEADLINE_S)).state
        except grpc.RpcError:
            return ""

    def _health_lost(self, reason: str) -> None:
        logger.info("engine %s: health watch lost (%s)", self.address, reason)
        self.serving = False
        self.recovering = False

    def _lost(self, reason: str) -> None:
        error = EngineDeadError(f"engine {self.address}: {reason}")
        if self.ready.is_set():
            logger.warning("%s", error)
        else:
            logger.debug("%s", error)
        self.ready.clear()
        self.on_state()
        for request_id, outputs in list(self._sinks.items()):
            outputs.put_nowait(EngineLostError(str(error), self, request_id, self.sessions))
