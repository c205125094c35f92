"""``GrpcExecutor``: the engine drives worker services over their ``CollectiveRPC`` streams.

Same contract as ``UniProcExecutor``: ``collective_rpc`` runs one allow-listed method on every
worker (in rank order) and returns their results, or a future of them with ``non_block=True``.
Arguments are converted to typed protobuf payloads here; nothing is pickled. A worker that dies
makes every call fail with ``EngineDeadError`` and calls ``on_failure`` (the engine service uses
it to report NOT_SERVING even while idle).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Any, Optional, Union

from gridserve.services.engine.executor.base import Executor, check_worker_method
from gridserve.services.engine.executor.worker_stream import WorkerStream
from gridserve.shared.errors import ConfigError, EngineDeadError
from gridserve.shared.rpc.worker_convert import config_to_pb, scheduler_output_to_pb
from gridserve.worker.v1 import worker_pb2

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = float(os.environ.get("GRIDSERVE_WORKER_CONNECT_TIMEOUT_S", "30"))
# Deadline of one call: a step, or loading a model (init_device / load_model / wake_up).
STEP_TIMEOUT_S = float(os.environ.get("GRIDSERVE_STEP_TIMEOUT_S", "120"))
LOAD_TIMEOUT_S = float(os.environ.get("GRIDSERVE_LOAD_TIMEOUT_S", "900"))
_SLOW_METHODS = {"init_device", "load_model", "wake_up", "determine_available_memory"}


class GrpcExecutor(Executor):
    """Drives the worker services listed in ``config.parallel.worker_addresses``."""

    on_failure: Optional[Callable[[Exception], None]] = None

    def _init_executor(self) -> None:
        addresses = self.config.parallel.worker_addresses
        if not addresses:
            raise ConfigError("parallel.worker_addresses", "the grpc executor needs worker addresses")
        if len(addresses) != self.config.parallel.world_size:
            raise ConfigError(
                "parallel.worker_addresses",
                f"{len(addresses)} workers given for world size {self.config.parallel.world_size}",
            )
        self.workers = [WorkerStream(a, CONNECT_TIMEOUT_S, self._on_worker_failure) for a in addresses]
        self.collective_rpc("init_device")
        self.collective_rpc("load_model")

    def _on_worker_failure(self, error: Exception) -> None:
        if self.on_failure is not None:
            self.on_failure(error)

    def collective_rpc(
        self,
        method: str,
        timeout: Optional[float] = None,
        args: tuple = (),
        kwargs: Optional[dict[str, Any]] = None,
        non_block: bool = False,
    ) -> Union[list[Any], Future]:
        check_worker_method(method)
        timeout = timeout or (LOAD_TIMEOUT_S if method in _SLOW_METHODS else STEP_TIMEOUT_S)
        shared = self._payload(method, args, kwargs or {})
        futures = [
            worker.call(method, **{method: self._per_rank(method, rank, shared)})
            for rank, worker in enumerate(self.workers)
        ]
        if non_block:
            return _gather(futures, timeout, self)
        return [self._wait(f, timeout, method) for f in futures]

    def _wait(self, future: Future, timeout: float, method: str) -> Any:
        try:
            return future.result(timeout=timeout)
        except FutureTimeoutError:
            error = EngineDeadError(f"a worker did not answer {method} within {timeout:.0f} s")
            for worker in self.workers:
                worker.fail(error)
            raise error from None

    def _payload(self, method: str, args: tuple, kwargs: dict[str, Any]) -> Any:
        if method == "execute_model":
            return worker_pb2.ExecuteModelArgs(scheduler_output=scheduler_output_to_pb(args[0]))
        if method == "initialize_cache":
            return worker_pb2.InitializeCacheArgs(num_blocks=kwargs.get("num_blocks", args[0] if args else 0))
        if method == "sleep":
            return worker_pb2.SleepArgs(level=kwargs.get("level", args[0] if args else 1))
        if method == "wake_up":
            return worker_pb2.WakeUpArgs(tags=kwargs.get("tags", args[0] if args else None) or [])
        if method == "init_device":
            return config_to_pb(self.config)
        return _EMPTY_ARGS[method]()

    @staticmethod
    def _per_rank(method: str, rank: int, shared: Any) -> Any:
        if method == "init_device":
            return worker_pb2.InitDeviceArgs(config=shared, rank=rank, local_rank=rank)
        return shared

    def shutdown(self) -> None:
        try:
            self.collective_rpc("shutdown", timeout=5.0)
        except Exception as exc:  # noqa: BLE001 - the workers may already be gone
            logger.info("worker shutdown: %s", exc)
        for worker in self.workers:
            worker.close()


_EMPTY_ARGS = {
    "load_model": worker_pb2.LoadModelArgs,
    "determine_available_memory": worker_pb2.DetermineAvailableMemoryArgs,
    "check_health": worker_pb2.CheckHealthArgs,
    "shutdown": worker_pb2.ShutdownArgs,
}


def _gather(futures: list[Future], timeout: float, executor: GrpcExecutor) -> Future:
    """One future of every worker's result, failing with the first error, or after ``timeout``."""
    combined: Future = Future()
    lock = threading.Lock()
    remaining = [len(futures)]

    def expire() -> None:
        if not combined.done():
            error = EngineDeadError(f"a worker did not answer within {timeout:.0f} s")
            for worker in executor.workers:
                worker.fail(error)

    timer = threading.Timer(timeout, expire)
    timer.daemon = True

    def done(_: Future) -> None:
        with lock:
            remaining[0] -= 1
            if remaining[0] != 0:
                return
        timer.cancel()
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:
            combined.set_exception(errors[0])
        else:
            combined.set_result([f.result() for f in futures])

    timer.start()
    for future in futures:
        future.add_done_callback(done)
    return combined
