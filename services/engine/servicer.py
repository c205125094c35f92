"""The engine's gRPC servicer: ``EngineCore`` data plane and control plane, proto <-> domain only."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Optional

import grpc

from gridserve.api.engine.v1 import engine_pb2, engine_pb2_grpc
from gridserve.services.engine.loop import EngineLoop
from gridserve.services.engine.request import Request
from gridserve.services.engine.status import EngineStatus
from gridserve.shared.config import GridserveConfig
from gridserve.shared.errors import EngineDeadError, InvalidArgumentError
from gridserve.shared.observability.tracing import traceparent_from_metadata
from gridserve.shared.rpc.convert import engine_output_to_pb, sampling_params_from_pb

logger = logging.getLogger(__name__)


class EngineServicer(engine_pb2_grpc.EngineCoreServicer):
    """Translates RPCs into ``EngineLoop`` calls."""

    def __init__(self, config: GridserveConfig, metrics_port: int = 0, tracing: bool = False) -> None:
        self.config = config
        self.metrics_port = metrics_port
        self.tracing = tracing  # read the caller's traceparent from the metadata
        self._loop: Optional[EngineLoop] = None
        self.status = EngineStatus(config.parallel.worker_addresses, lambda: self.loop.stats(timeout=5.0))

    @property
    def loop(self) -> EngineLoop:
        if self._loop is None:
            raise EngineDeadError("the engine is still starting (loading the model on its workers)")
        return self._loop

    @loop.setter
    def loop(self, loop: EngineLoop) -> None:
        self._loop = loop

    def AddRequest(self, request: engine_pb2.AddRequestRequest, context: grpc.ServicerContext):
        if not request.request_id:
            raise InvalidArgumentError("request_id", "must not be empty")
        if not request.prompt_token_ids:
            raise InvalidArgumentError("prompt_token_ids", "must not be empty")
        domain = Request(
            request.request_id,
            list(request.prompt_token_ids),
            sampling_params_from_pb(request.sampling_params),
            eos_token_id=self.config.model.eos_token_id,
            cache_salt=request.cache_salt if request.HasField("cache_salt") else None,
            parent_request_id=request.parent_request_id if request.HasField("parent_request_id") else None,
        )
        if self.tracing:
            domain.traceparent = traceparent_from_metadata(context.invocation_metadata())
        self.loop.add_request(domain, request.gateway_id)
        return engine_pb2.AddRequestResponse()

    def AbortRequests(self, request: engine_pb2.AbortRequestsRequest, context: grpc.ServicerContext):
        aborted = self.loop.abort(list(request.request_ids))
        return engine_pb2.AbortRequestsResponse(aborted_request_ids=aborted)

    def StreamOutputs(
        self, request: engine_pb2.StreamOutputsRequest, context: grpc.ServicerContext
    ) -> Iterator[engine_pb2.StreamOutputsResponse]:
        if not request.gateway_id:
            raise InvalidArgumentError("gateway_id", "must not be empty")
        for batch in self.loop.outputs(request.gateway_id, context.is_active):
            yield engine_pb2.StreamOutputsResponse(outputs=[engine_output_to_pb(o) for o in batch])

    def GetInfo(self, request: engine_pb2.GetInfoRequest, context: grpc.ServicerContext):
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
        )

    def GetLoad(self, request: engine_pb2.GetLoadRequest, context: grpc.ServicerContext):
        load = self.loop.load()
        return engine_pb2.GetLoadResponse(**vars(load))

    def Sleep(self, request: engine_pb2.SleepRequest, context: grpc.ServicerContext):
        if request.level not in (0, 1, 2):
            raise InvalidArgumentError("level", f"must be 1 or 2, got {request.level}")
        self.loop.sleep(request.level or 1)
        return engine_pb2.SleepResponse()

    def WakeUp(self, request: engine_pb2.WakeUpRequest, context: grpc.ServicerContext):
        self.loop.wake_up(list(request.tags) or None)
        return engine_pb2.WakeUpResponse()

    def ResetPrefixCache(self, request: engine_pb2.ResetPrefixCacheRequest, context: grpc.ServicerContext):
        return engine_pb2.ResetPrefixCacheResponse(reset=self.loop.call(self.loop.core.reset_prefix_cache))

    def GetStatus(self, request: engine_pb2.GetStatusRequest, context: grpc.ServicerContext):
        report = self.status.report()
        stats = report.stats
        return engine_pb2.GetStatusResponse(
            workers=[engine_pb2.WorkerStatus(rank=w.rank, address=w.address, health=w.health)
                     for w in report.workers],
            loop_alive=report.loop_alive, error=report.error,
            num_generation_tokens=stats.num_generation_tokens if stats else 0,
            num_prompt_tokens=stats.num_prompt_tokens if stats else 0,
        )
