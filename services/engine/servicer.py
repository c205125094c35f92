"""The engine's gRPC servicer: ``EngineCore`` data plane and control plane, proto <-> domain only.

Every handler is ``async`` and runs on the server's event loop; it hands the work to the
``EngineLoop`` thread and awaits the answer. Each gateway's ``StreamOutputs`` is an async generator
fed by a ``_LoopSink``: the engine thread puts one batch per step, the loop converts and sends it.
A stream and the requests routed to it belong to the caller's verified identity (``_stream_key``):
with a certificate per gateway instance, one gateway cannot subscribe to, feed or abort another's.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from concurrent.futures import Future
from typing import Any, Optional

import grpc
from google.protobuf import struct_pb2

from gridserve.api.common.v1 import common_pb2
from gridserve.api.engine.v1 import engine_pb2, engine_pb2_grpc
from gridserve.services.engine.executor.base import is_extension_method
from gridserve.services.engine.kv_transfers import check_consumer, check_producer
from gridserve.services.engine.loop import END, EngineLoop
from gridserve.services.engine.lora_adapters import LoadedAdapter, LoRAAdapters, adapter_for
from gridserve.services.engine.request import Request
from gridserve.services.engine.request_checks import check_prompt_ids, check_request
from gridserve.services.engine.status import EngineStatus
from gridserve.shared.config import GridserveConfig
from gridserve.shared.errors import (
    EngineDeadError,
    FailedPreconditionError,
    InvalidArgumentError,
    PermissionDeniedError,
)
from gridserve.shared.kv_transfer import KVLayout
from gridserve.shared.lora import LoRARequest
from gridserve.shared.observability.tracing import traceparent_from_metadata
from gridserve.shared.pooling import embedding_size
from gridserve.shared.request_checks import check_cache_salt
from gridserve.shared.rpc.authz import stream_owner
from gridserve.shared.rpc.convert import (
    engine_output_to_pb,
    image_features_from_pb,
    pooling_params_from_pb,
    sampling_params_from_pb,
)
from gridserve.shared.rpc.kv_convert import kv_layout_to_pb, kv_params_from_pb, kv_stats_to_pb
from gridserve.shared.rpc.values import decode, encode
from gridserve.shared.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def _check_continuation(request: engine_pb2.AddRequestRequest, params: Any, max_model_len: int,
                        vocab_size: int) -> None:
    """A continuation's tokens so far must be token ids and leave room for at least one more."""
    done = len(request.output_token_ids)
    if not done:
        return
    bad = next((t for t in request.output_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidArgumentError("output_token_ids", f"token id {bad} is outside [0, {vocab_size})")
    if params.max_tokens is not None and done >= params.max_tokens:
        raise InvalidArgumentError("output_token_ids", f"{done} tokens already reach max_tokens={params.max_tokens}")
    if len(request.prompt_token_ids) + done >= max_model_len:
        raise InvalidArgumentError("output_token_ids", f"prompt + {done} output tokens reach max_model_len={max_model_len}")


class EngineServicer(engine_pb2_grpc.EngineCoreServicer):
    """Translates RPCs into ``EngineLoop`` calls."""

    def __init__(self, config: GridserveConfig, metrics_port: int = 0, tracing: bool = False) -> None:
        self.config = config
        self.metrics_port = metrics_port
        self.tracing = tracing  # read the caller's traceparent from the metadata
        self._loop: Optional[EngineLoop] = None
        self.status = EngineStatus(config.parallel.worker_addresses, lambda: self.loop.stats())

    @property
    def loop(self) -> EngineLoop:
        if self._loop is None:
            raise EngineDeadError("the engine is still starting (loading the model on its workers)")
        return self._loop

    @loop.setter
    def loop(self, loop: EngineLoop) -> None:
        self._loop = loop

    async def AddRequest(self, request: engine_pb2.AddRequestRequest, context: grpc.aio.ServicerContext):
        if not request.request_id:
            raise InvalidArgumentError("request_id", "must not be empty")
        if request.mm_features and "vision_config" not in self.config.model.hf_config:
            raise InvalidArgumentError("mm_features", f"{self.config.model.architecture} takes text only")
        prompt = list(request.prompt_token_ids)
        pooling = pooling_params_from_pb(request.pooling_params) if request.HasField("pooling_params") else None
        if pooling is not None:  # checked against the model by the core (check_runner); a oneof with sampling_params
            params = SamplingParams(max_tokens=1)
            check_prompt_ids(self.config, prompt)
        else:
            params = sampling_params_from_pb(request.sampling_params)
            check_request(self.config, prompt, params)  # never trust the caller: ids, lengths, ranges
        _check_continuation(request, params, self.config.max_model_len, self.config.model.vocab_size)
        if request.HasField("cache_salt"):
            check_cache_salt(request.cache_salt)
        domain = Request(
            request.request_id,
            prompt,
            params,
            eos_token_id=self.config.model.eos_token_id,
            cache_salt=request.cache_salt if request.HasField("cache_salt") else None,
            parent_request_id=request.parent_request_id if request.HasField("parent_request_id") else None,
            mm_features=image_features_from_pb(request.mm_features, len(request.prompt_token_ids)),
            output_token_ids=list(request.output_token_ids),
            lora_request=self._lora_of(request),
            pooling_params=pooling,
            token_type_ids=list(request.token_type_ids) or None,
            priority=request.priority,
            **kv_transfer_of(self.config, request),
        )
        domain.admit_always = request.continuation
        if self.tracing:
            domain.traceparent = traceparent_from_metadata(context.invocation_metadata())
        await _done(self.loop.add_request(domain, _stream_key(context, request.gateway_id)))
        return engine_pb2.AddRequestResponse()

    def _lora_of(self, request: engine_pb2.AddRequestRequest) -> Optional[LoRARequest]:
        """The adapter a request names (by ``lora_name``: the table gives its id and folder)."""
        if not request.HasField("lora_request"):
            return None
        return adapter_for(self.loop.core.lora, request.lora_request.lora_name)

    async def AbortRequests(self, request: engine_pb2.AbortRequestsRequest, context: grpc.aio.ServicerContext):
        owner = stream_owner(context)  # a gateway aborts only its own requests; admin (or plaintext) any
        aborted = await _done(self.loop.abort(list(request.request_ids), None if owner in (None, "admin") else owner))
        return engine_pb2.AbortRequestsResponse(aborted_request_ids=aborted)

    async def StreamOutputs(
        self, request: engine_pb2.StreamOutputsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.StreamOutputsResponse]:
        """The gateway's outputs, one message per engine step (the first one empty: the stream is open)."""
        if not request.gateway_id:
            raise InvalidArgumentError("gateway_id", "must not be empty")
        loop, key = self.loop, _stream_key(context, request.gateway_id)
        sink = _LoopSink(asyncio.get_running_loop())
        await _done(loop.open_stream(key, sink))
        try:
            yield engine_pb2.StreamOutputsResponse()
            while True:
                item = await sink.queue.get()
                if item is END:
                    return
                if isinstance(item, Exception):
                    raise item
                yield engine_pb2.StreamOutputsResponse(outputs=[engine_output_to_pb(o) for o in item])
        finally:
            loop.close_stream(key, sink)

    async def GetInfo(self, request: engine_pb2.GetInfoRequest, context: grpc.aio.ServicerContext):
        model, cache = self.config.model, self.config.cache
        return engine_pb2.GetInfoResponse(
            model=model.model,
            model_path=model.model_path,
            tokenizer_path=model.tokenizer_path,
            max_model_len=self.config.max_model_len,
            vocab_size=model.vocab_size,
            block_size=cache.block_size,
            num_kv_blocks=cache.num_blocks or 0,
            num_workers=self.config.parallel.world_size,
            max_logprobs=model.max_logprobs,
            metrics_port=self.metrics_port,
            kv_role=cache.kv_role or "",
            kv_layout=self._kv_layout(),
            default_sampling_params=common_pb2.SamplingParams(**model.default_sampling_params),
            kv_cache_groups=self._kv_cache_groups(),
            runner=model.runner,
            supported_tasks=list(self.config.pooling_tasks),
            # a pooling model's vector size (its last sentence-transformers Dense module's, if any)
            hidden_size=(embedding_size(model.model_path, int(model.text_config.get("hidden_size", 0)))
                         if model.runner == "pooling" else 0),
        )

    def _kv_layout(self):
        """With a kv_role, once the KV cache is planned: what a P/D partner must share; else None."""
        groups = self._kv_cache_groups()
        if not self.config.cache.kv_role or not groups:
            return None
        model, cache, parallel = self.config.model, self.config.cache, self.config.parallel
        return kv_layout_to_pb(KVLayout(
            block_size=cache.block_size, kv_cache_dtype=cache.kv_cache_dtype, model=model.model,
            quantization=model.quantization or "", world_size=parallel.world_size,
            tensor_parallel_size=parallel.tensor_parallel_size, num_kv_cache_groups=len(groups)))

    def _kv_cache_groups(self) -> list[engine_pb2.KVCacheGroupInfo]:
        """The planned groups; none while the engine starts (no core yet: GetInfo answers anyway)."""
        core = self._loop.core if self._loop is not None else None
        plan = getattr(core, "kv_cache_config", None)
        if plan is None:
            return []
        return [engine_pb2.KVCacheGroupInfo(name=g.name, kind=g.kind, sliding_window=g.sliding_window,
                                            num_layers=len(g.layer_names)) for g in plan.groups]

    async def GetLoad(self, request: engine_pb2.GetLoadRequest, context: grpc.aio.ServicerContext):
        load = await _done(self.loop.load())
        return engine_pb2.GetLoadResponse(
            num_waiting=load.num_waiting, num_running=load.num_running, kv_cache_usage=load.kv_cache_usage,
            kv_free_blocks=load.kv_free_blocks, kv_total_blocks=load.kv_total_blocks,
            num_preemptions=load.num_preemptions, sleeping=load.sleeping, state=load.state,
            prefix_cache_queries=load.prefix_cache_queries, prefix_cache_hits=load.prefix_cache_hits,
            kv_cache_groups=[engine_pb2.KVCacheGroupLoad(
                name=name, num_blocks=blocks, usage=blocks / load.kv_total_blocks if load.kv_total_blocks else 0.0)
                for name, blocks in load.kv_cache_groups],
            kv_transfers=kv_stats_to_pb(load.kv_transfers),
        )

    async def Sleep(self, request: engine_pb2.SleepRequest, context: grpc.aio.ServicerContext):
        if request.level not in (0, 1, 2):
            raise InvalidArgumentError("level", f"must be 1 or 2, got {request.level}")
        reports = await _done(self.loop.sleep(request.level or 1))
        return engine_pb2.SleepResponse(sleeping_tags=self.loop.core.sleeping_tags,
                                        worker_memory=[_struct(r) for r in reports])

    async def WakeUp(self, request: engine_pb2.WakeUpRequest, context: grpc.aio.ServicerContext):
        reports = await _done(self.loop.wake_up(list(request.tags) or None))
        return engine_pb2.WakeUpResponse(sleeping_tags=self.loop.core.sleeping_tags,
                                         worker_memory=[_struct(r) for r in reports])

    async def CollectiveRpc(self, request: engine_pb2.CollectiveRpcRequest, context: grpc.aio.ServicerContext):
        """A worker extension method on every worker (built-in worker methods have their own RPCs)."""
        if not request.method:
            raise InvalidArgumentError("method", "must not be empty")
        if not is_extension_method(request.method):
            raise PermissionDeniedError(f"{request.method!r} is a built-in worker method, not an extension's")
        if request.HasField("timeout_s") and request.timeout_s <= 0:
            raise InvalidArgumentError("timeout_s", f"must be positive, got {request.timeout_s}")
        unique = request.unique_reply_rank if request.HasField("unique_reply_rank") else None
        results = await _done(self.loop.collective_rpc(
            request.method, tuple(decode(v) for v in request.args),
            {k: decode(v) for k, v in request.kwargs.items()},
            request.timeout_s if request.HasField("timeout_s") else None, unique))
        return engine_pb2.CollectiveRpcResponse(results=[encode(r) for r in ([results] if unique is not None else results)])

    async def ResetPrefixCache(self, request: engine_pb2.ResetPrefixCacheRequest,
                               context: grpc.aio.ServicerContext):
        reset = await _done(self.loop.submit(self.loop.core.reset_prefix_cache))
        return engine_pb2.ResetPrefixCacheResponse(reset=reset)


    # ---- LoRA adapters ---------------------------------------------------------------------
    def _lora_table(self) -> LoRAAdapters:
        table = self.loop.core.lora
        if table is None:
            raise FailedPreconditionError("this engine serves no LoRA adapters (start it with --enable-lora)")
        return table

    async def LoadLoraAdapter(self, request: engine_pb2.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext):
        table = self._lora_table()
        adapter = await _done(self.loop.submit(lambda: table.load(request.lora_name, request.lora_path)))
        return engine_pb2.LoadLoraAdapterResponse(adapter=_adapter_pb(adapter))

    async def UnloadLoraAdapter(self, request: engine_pb2.UnloadLoraAdapterRequest,
                                context: grpc.aio.ServicerContext):
        table = self._lora_table()
        await _done(self.loop.submit(lambda: table.unload(request.lora_name)))
        return engine_pb2.UnloadLoraAdapterResponse()

    async def ListLoraAdapters(self, request: engine_pb2.ListLoraAdaptersRequest,
                               context: grpc.aio.ServicerContext):
        lora = self.config.lora
        table = self.loop.core.lora
        return engine_pb2.ListLoraAdaptersResponse(
            adapters=[_adapter_pb(a) for a in (table.list() if table is not None else [])],
            enable_lora=lora.enable_lora, max_loras=lora.max_loras, max_lora_rank=lora.max_lora_rank,
            started=table.started if table is not None else 0.0)

    async def GetStatus(self, request: engine_pb2.GetStatusRequest, context: grpc.aio.ServicerContext):
        report = await self.status.report()  # asks the workers (aio health calls), awaits the loop
        stats = report.stats
        return engine_pb2.GetStatusResponse(
            workers=[engine_pb2.WorkerStatus(rank=w.rank, address=w.address, health=w.health)
                     for w in report.workers],
            loop_alive=report.loop_alive, error=report.error,
            num_generation_tokens=stats.num_generation_tokens if stats else 0,
            num_prompt_tokens=stats.num_prompt_tokens if stats else 0,
        )


def kv_transfer_of(config: GridserveConfig, request: engine_pb2.AddRequestRequest) -> dict[str, Any]:
    """Disaggregated serving: ``kv_transfer_params`` without a transfer id asks a producer to run the
    prompt only and hold its blocks; with one, a consumer pulls those blocks (checked here)."""
    params = kv_params_from_pb(request)
    if params is None:
        return {}
    if not params.transfer_id:
        check_producer(config)
        return {"prefill_only": True}
    check_consumer(config, params, len(request.prompt_token_ids), len(request.output_token_ids))
    return {"kv_transfer_params": params}


def _stream_key(context: grpc.aio.ServicerContext, gateway_id: str) -> str:
    """The engine's name for a caller's output stream: its ``gateway_id`` in the namespace of the
    caller's verified identity (``gateway-0/gw-1a2b``), so no caller opens, feeds or takes over
    another's stream; without TLS the id alone, as the caller wrote it."""
    owner = stream_owner(context)
    return gateway_id if owner is None else f"{owner}/{gateway_id}"


def _adapter_pb(adapter: LoadedAdapter) -> engine_pb2.LoraAdapter:
    r = adapter.request
    return engine_pb2.LoraAdapter(lora_name=r.lora_name, lora_int_id=r.lora_int_id, lora_path=r.lora_path,
                                  created=adapter.created)


def _struct(values: dict) -> struct_pb2.Struct:
    message = struct_pb2.Struct()
    message.update(values)
    return message


async def _done(future: Future) -> Any:
    """Await an ``EngineLoop`` future without blocking the event loop."""
    return await asyncio.wrap_future(future)


class _LoopSink:
    """A gateway's batches, put by the engine thread, read by its stream on the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item: Any) -> None:
        self._loop.call_soon_threadsafe(self.queue.put_nowait, item)
