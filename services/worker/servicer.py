"""The worker's gRPC servicer: ``Worker.CollectiveRPC``, one call at a time, in order.

Each request names one method of the allow-list by its payload (``call_extension``: a public
method of the worker extension, by name); the servicer converts the payload
to domain objects, calls the ``Worker`` method and converts the result back. The first call must
be ``init_device``: it carries the engine's configuration and creates the ``Worker``.

The stream is an async generator on the server's event loop; every worker method (the forward
pass above all) runs in the servicer's one ``worker`` thread, so torch and its process groups are
always driven from the same thread and the loop stays free for health checks and keepalives.
Around ``execute_model`` the KV connector's step hook (``kv_transfer.py``) registers / releases a
producer's transfers and pulls a consumer's KV (disaggregated prefill / decode).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import grpc

from gridserve.api.worker.v1 import worker_pb2, worker_pb2_grpc
from gridserve.services.worker.extension import call_extension, worker_class
from gridserve.services.worker.kv_connector import GrpcKVConnector, KVCacheView
from gridserve.services.worker.kv_transfer import KVStepHook
from gridserve.services.worker.observability import WorkerObserver
from gridserve.services.worker.parallel_state import get_parallel_state
from gridserve.services.worker.worker import Worker
from gridserve.shared.errors import FailedPreconditionError
from gridserve.shared.rpc.convert import lora_request_from_pb
from gridserve.shared.rpc.values import decode, encode
from gridserve.shared.rpc.worker_convert import (
    config_from_pb,
    kv_cache_config_from_pb,
    kv_cache_spec_to_pb,
    runner_output_to_pb,
    scheduler_output_from_pb,
)

logger = logging.getLogger(__name__)


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """Serves one engine's call stream; ``on_ready`` reports whether the worker can serve."""

    def __init__(self, on_ready: Callable[[bool], None],
                 on_orphaned: Optional[Callable[[int], None]] = None,
                 observer: Optional[WorkerObserver] = None, batch_invariant: bool = False) -> None:
        self.worker: Optional[Worker] = None
        self.batch_invariant = batch_invariant  # the worker's own --batch-invariant: on whatever the engine says
        self.observer = observer if observer is not None and observer.enabled else None  # metrics / spans
        self.on_ready = on_ready
        self.on_orphaned = on_orphaned
        self._shut_down = False
        self._driven = False  # one engine stream drives the worker at a time (checked on the loop)
        self._loaded = False
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="worker")
        # Disaggregated prefill / decode: the KV connector (served by main's KVTransfer service) and
        # its part of each step; idle unless the engine sends transfers or loads.
        self.kv_connector = GrpcKVConnector(KVCacheView(self._kv_caches, self._kv_cache_groups))
        self.kv_step = KVStepHook(self.kv_connector)

    async def CollectiveRPC(
        self, request_iterator: AsyncIterator[worker_pb2.CollectiveRPCRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[worker_pb2.CollectiveRPCResponse]:
        if self._driven:
            raise FailedPreconditionError("another engine already drives this worker")
        self._driven = True
        context.add_done_callback(lambda _call: self._stream_ended())
        loop = asyncio.get_running_loop()
        try:
            async for request in request_iterator:
                yield await loop.run_in_executor(self._thread, self._call, request)
        except grpc.RpcError:
            if not context.done():
                raise
            logger.info("engine stream closed")  # the engine went away (shutdown or failure)
        finally:
            self._driven = False

    def _kv_caches(self) -> list:
        return self.worker.runner.kv_caches if self.worker is not None and self.worker.runner is not None else []

    def _kv_cache_groups(self) -> list[tuple[int, ...]]:
        """Parallel to ``_kv_caches``: the KV cache groups whose layers use each tensor."""
        runner = self.worker.runner if self.worker is not None else None
        return runner.kv_cache_groups if runner is not None else []

    def _stream_ended(self) -> None:
        """A worker of a parallel group belongs to one engine session: when its stream ends (the
        engine shut down, failed, or gave up on the group) it exits, even out of a stuck collective."""
        if self.worker is None or self.worker.world_size == 1 or self.on_orphaned is None:
            return
        logger.warning("engine stream of rank %d ended%s: exiting", self.worker.rank,
                       "" if self._shut_down else " without shutdown")
        self.on_orphaned(0 if self._shut_down else 1)

    def _call(self, request: worker_pb2.CollectiveRPCRequest) -> worker_pb2.CollectiveRPCResponse:
        response = worker_pb2.CollectiveRPCResponse(call_id=request.call_id)
        method = request.WhichOneof("method")
        try:
            self._dispatch(method, getattr(request, method), response)
        except Exception as exc:  # noqa: BLE001 - returned to the engine as a typed error
            logger.exception("worker method %s failed", method)
            response.ClearField("result")
            response.error.type = type(exc).__name__
            response.error.message = str(exc)
        return response

    def _dispatch(self, method: Optional[str], args, response: worker_pb2.CollectiveRPCResponse) -> None:
        if method == "init_device":
            config = config_from_pb(args.config)
            config.device.batch_invariant = config.device.batch_invariant or self.batch_invariant
            self.worker = worker_class(config)(config, rank=args.rank, local_rank=args.local_rank,
                                               distributed_init_address=args.distributed_init_address)
            if args.world_size and args.world_size != self.worker.world_size:
                raise FailedPreconditionError(
                    f"world size {args.world_size} disagrees with the config's {self.worker.world_size}")
            self.worker.init_device()
            self.kv_step.rank = self.worker.rank
            if self.worker.world_size > 1:  # P/D: the ranks agree on failed KV pulls
                self.kv_step.agree = get_parallel_state().any_across_workers
            return
        if self.worker is None:
            raise FailedPreconditionError(f"{method} before init_device")
        worker = self.worker
        if method == "execute_model":
            plan = self.kv_step.before_step(scheduler_output_from_pb(args.scheduler_output))
            if self.observer is None:
                out = worker.execute_model(plan)
            else:
                out = self.observer.execute(worker.execute_model, plan, worker.rank)
            if out is not None:
                self.kv_step.after_step(out)
                response.model_runner_output.CopyFrom(runner_output_to_pb(out))
            elif (report := self.kv_step.report()) is not None:  # P/D: what this rank served / pulled
                response.model_runner_output.CopyFrom(runner_output_to_pb(report))
            # (otherwise other ranks answer with an empty ack)
        elif method == "determine_available_memory":
            response.available_memory_bytes = worker.determine_available_memory()
        elif method == "load_model":
            worker.load_model()
        elif method == "get_kv_cache_spec":
            response.kv_cache_spec.CopyFrom(kv_cache_spec_to_pb(worker.get_kv_cache_spec()))
        elif method == "initialize_cache":
            worker.initialize_cache(kv_cache_config_from_pb(args, worker.config.cache.block_size))
            self._loaded = True
            self.on_ready(True)
        elif method == "check_health":
            worker.check_health()
        elif method == "sleep":
            response.value.CopyFrom(encode(worker.sleep(args.level or 1)))
        elif method == "wake_up":
            response.value.CopyFrom(encode(worker.wake_up(list(args.tags) or None)))
        elif method == "add_lora":
            worker.add_lora(lora_request_from_pb(args.lora_request))
        elif method == "remove_lora":
            worker.remove_lora(args.lora_int_id)
        elif method == "list_loras":
            response.lora_ids.ids.extend(worker.list_loras())
        elif method == "call_extension":
            result = call_extension(worker, args.method, [decode(v) for v in args.args],
                                    {k: decode(v) for k, v in args.kwargs.items()})
            response.value.CopyFrom(encode(result))
        elif method == "shutdown":
            self._shut_down = True
            self.on_ready(False)
            worker.shutdown()
        else:
            raise FailedPreconditionError(f"unknown worker method {method!r}")
