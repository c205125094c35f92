"""``GrpcExecutor``: the engine drives worker services over their ``CollectiveRPC`` streams.

Same contract as ``UniProcExecutor``: ``collective_rpc`` runs one allow-listed method, or a worker
extension's method by name (``call_extension``), on every worker (in rank order) and returns their
results, or a future of them with ``non_block=True``.
Arguments are converted to typed protobuf payloads here; nothing is pickled. ``execute_model`` goes
to every worker but waits only for the output rank (TP rank 0 of the last pipeline stage). A worker
that dies, errs or stops answering fails the whole group: every call fails with ``EngineDeadError``,
the surviving workers' streams are closed (a worker of a parallel group then exits), and
``on_failure`` is called (the engine loop then starts a recovery, even while idle).
``reinitialize`` rebuilds the group once its workers are back (the launcher or Kubernetes restarts
them): new streams, device, weights and a KV cache of the same size. Each rebuild is a new
*generation*: failures reported by the streams of an older one are ignored.

The streams run on the executor's own event loop (a ``LoopThread``): the engine's busy loop is a
plain thread that hands each call to it and waits on ``concurrent.futures`` futures. Its own loop,
not the engine server's, so a step's round trip never queues behind the gateways' output streams.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Any, Optional, Union

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gridserve.api.worker.v1 import worker_pb2
from gridserve.services.engine.executor.base import (
    Executor,
    chain_first,
    check_worker_method,
    is_extension_method,
)
from gridserve.services.engine.executor.worker_stream import WorkerStream
from gridserve.shared import envs
from gridserve.shared.errors import ConfigError, EngineDeadError, InvalidArgumentError
from gridserve.shared.kv_cache_spec import KVCacheConfig
from gridserve.shared.parallel import output_rank
from gridserve.shared.ports import free_port
from gridserve.shared.rpc.client import aio_channel
from gridserve.shared.rpc.convert import lora_request_to_pb
from gridserve.shared.rpc.loop_thread import LoopThread
from gridserve.shared.rpc.values import encode
from gridserve.shared.rpc.worker_convert import (
    config_to_pb,
    kv_cache_config_to_pb,
    scheduler_output_to_pb,
)
from gridserve.shared.scheduler_output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

# Deadline of one call: a step, or loading a model (init_device / load_model / wake_up).
_SLOW_METHODS = {"init_device", "load_model", "wake_up", "determine_available_memory"}
_RECONNECT_POLL_S = 0.25  # how often a recovery asks a worker that is not back yet


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
        parallel = self.config.parallel
        self.output_rank = output_rank(parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
        self.init_address = ""
        if parallel.world_size > 1:
            self.init_address = parallel.distributed_init_address or _local_rendezvous(addresses)
        self._group_failed = threading.Event()
        self._generation = 0  # bumped by every rebuild of the group
        self._generation_lock = threading.Lock()
        self.workers: list[WorkerStream] = []
        self._runner = LoopThread("worker-rpc")
        try:
            self._connect_all(time.monotonic() + envs.GRIDSERVE_WORKER_CONNECT_TIMEOUT_S)
        except BaseException:
            self._close_workers(self.workers)
            self._runner.stop()
            raise
        self.collective_rpc("init_device")
        self.collective_rpc("load_model")

    def _connect_all(self, deadline: float) -> None:
        generation = self._generation
        for address in self.config.parallel.worker_addresses:
            remaining = max(deadline - time.monotonic(), 0.1)
            self.workers.append(self._runner.run(WorkerStream.connect(
                address, remaining, lambda error, g=generation: self._on_worker_failure(error, g))))

    @property
    def healthy(self) -> bool:
        """No worker of the current generation has failed."""
        return not self._group_failed.is_set()

    def reinitialize(self, kv_cache_config: KVCacheConfig, timeout_s: float) -> None:
        """Rebuild the group after a failure: wait for every worker to be back (a rank of a parallel
        group must be a fresh process), open new streams, and run ``init_device``, ``load_model`` and
        ``initialize_cache(kv_cache_config)`` on them. Retries until ``timeout_s``, then raises
        ``EngineDeadError``. Called from the engine loop's recovery (never from the executor's loop).
        """
        deadline = time.monotonic() + timeout_s
        parallel = self.config.parallel.world_size > 1
        while True:
            with self._generation_lock:
                self._generation += 1
                old, self.workers = self.workers, []
                self._group_failed.clear()
            self._close_workers(old)  # surviving ranks of a parallel group exit and are restarted
            try:
                for address in self.config.parallel.worker_addresses:
                    self._runner.run(_wait_back(address, fresh=parallel, deadline=deadline))
                self._connect_all(deadline)
                self.collective_rpc("init_device", timeout=max(deadline - time.monotonic(), 1.0))
                self.collective_rpc("load_model", timeout=max(deadline - time.monotonic(), 1.0))
                self.initialize_cache(kv_cache_config)
                if self.healthy:
                    self.sleeping_tags = set()  # a rebuilt group is awake
                    return
                raise EngineDeadError("a worker failed while the group was rebuilt")
            except Exception as exc:  # noqa: BLE001 - retried until the deadline
                if time.monotonic() >= deadline:
                    raise EngineDeadError(f"the worker group is not back within {timeout_s:.0f} s: {exc}") from exc
                logger.warning("worker group not back yet (%s): retrying", exc)
                time.sleep(_RECONNECT_POLL_S)

    def _on_worker_failure(self, error: Exception, generation: Optional[int] = None) -> None:
        """One worker failed: the whole group is dead (its peers cannot finish a collective without it).

        Every other stream fails with the same error and is then closed, which tells the surviving
        ranks of a parallel group to exit instead of waiting in a collective for the lost one.
        A failure of an older generation (a stream a rebuild already replaced) is ignored.
        """
        with self._generation_lock:
            if self._group_failed.is_set() or generation not in (None, self._generation):
                return
            self._group_failed.set()
            workers = list(self.workers)
        dead = error if isinstance(error, EngineDeadError) else EngineDeadError(str(error))
        for worker in workers:
            worker.fail(dead)
        if len(workers) > 1:
            threading.Thread(target=self._close_workers, args=(workers,), name="close-workers",
                             daemon=True).start()
        if self.on_failure is not None:
            self.on_failure(dead)

    def _close_workers(self, workers: list[WorkerStream]) -> None:
        """End these workers' streams (from any thread but the executor's loop)."""
        async def close_all() -> None:
            await asyncio.gather(*(worker.close() for worker in workers), return_exceptions=True)

        self._runner.run(close_all())

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> Union[ModelRunnerOutput, Future]:
        """Send the step to every worker; wait only for the output rank (the others send empty acks).

        A non-output rank that answers with an error fails the whole group. Disaggregated serving
        with several workers waits for every rank: each reports the KV shards it served or pulled,
        added into the output rank's output (``_merge_kv``).
        """
        payload = worker_pb2.ExecuteModelArgs(scheduler_output=scheduler_output_to_pb(scheduler_output))
        futures = [worker.call("execute_model", execute_model=payload) for worker in self.workers]
        generation = self._generation
        for rank, future in enumerate(futures):
            if rank != self.output_rank:
                future.add_done_callback(lambda f, g=generation: self._fail_group_on_error(f, g))
        merge = bool(self.config.cache.kv_role) and len(futures) > 1
        if not non_block and not merge:
            return self._wait(futures[self.output_rank], envs.GRIDSERVE_STEP_TIMEOUT_S, "execute_model")
        result: Future = Future()
        if merge:
            _gather(futures, envs.GRIDSERVE_STEP_TIMEOUT_S, self).add_done_callback(
                lambda f: _merge_kv(f, result, self.output_rank))
        else:
            _gather([futures[self.output_rank]], envs.GRIDSERVE_STEP_TIMEOUT_S, self).add_done_callback(
                lambda f: chain_first(f, result))
        if not non_block:
            return self._wait(result, envs.GRIDSERVE_STEP_TIMEOUT_S, "execute_model")
        return result

    def _fail_group_on_error(self, future: Future, generation: int) -> None:
        error = future.exception()
        if error is not None:
            self._on_worker_failure(EngineDeadError(f"worker group failed: {error}"), generation)

    def collective_rpc(
        self,
        method: str,
        timeout: Optional[float] = None,
        args: tuple = (),
        kwargs: Optional[dict[str, Any]] = None,
        non_block: bool = False,
        unique_reply_rank: Optional[int] = None,
    ) -> Union[list[Any], Any, Future]:
        check_worker_method(method)
        if unique_reply_rank is not None and not 0 <= unique_reply_rank < len(self.workers):
            raise InvalidArgumentError("unique_reply_rank", f"rank {unique_reply_rank} of {len(self.workers)} workers")
        timeout = timeout or (envs.GRIDSERVE_LOAD_TIMEOUT_S if method in _SLOW_METHODS
                              else envs.GRIDSERVE_STEP_TIMEOUT_S)
        field = "call_extension" if is_extension_method(method) else method
        shared = self._payload(method, args, kwargs or {})
        futures = [
            worker.call(field, **{field: self._per_rank(method, rank, shared)})
            for rank, worker in enumerate(self.workers)
        ]
        if unique_reply_rank is not None:
            futures = [futures[unique_reply_rank]]
        if non_block:
            combined = _gather(futures, timeout, self)
            if unique_reply_rank is None:
                return combined
            single: Future = Future()
            combined.add_done_callback(lambda f: chain_first(f, single))
            return single
        results = [self._wait(f, timeout, method) for f in futures]
        return results[0] if unique_reply_rank is not None else results

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
            return kv_cache_config_to_pb(kwargs.get("kv_cache_config", args[0] if args else None))
        if method == "sleep":
            return worker_pb2.SleepArgs(level=kwargs.get("level", args[0] if args else 1))
        if method == "wake_up":
            return worker_pb2.WakeUpArgs(tags=kwargs.get("tags", args[0] if args else None) or [])
        if method == "init_device":
            return config_to_pb(self.config)
        if method == "add_lora":
            return worker_pb2.AddLoraArgs(lora_request=lora_request_to_pb(kwargs.get("lora_request", args[0] if args else None)))
        if method == "remove_lora":
            return worker_pb2.RemoveLoraArgs(lora_int_id=kwargs.get("lora_int_id", args[0] if args else 0))
        if is_extension_method(method):
            return worker_pb2.ExtensionCallArgs(method=method, args=[encode(a) for a in args],
                                                kwargs={k: encode(v) for k, v in kwargs.items()})
        return _EMPTY_ARGS[method]()

    def _per_rank(self, method: str, rank: int, shared: Any) -> Any:
        if method == "init_device":
            return worker_pb2.InitDeviceArgs(
                config=shared, rank=rank, local_rank=self._local_rank_of(rank),
                world_size=self.config.parallel.world_size, distributed_init_address=self.init_address,
            )
        return shared

    def _local_rank_of(self, rank: int) -> int:
        """The device index of worker ``rank`` on its machine."""
        return _local_rank(self.config.parallel.worker_addresses, rank)

    def shutdown(self) -> None:
        try:
            self.collective_rpc("shutdown", timeout=5.0)
        except Exception as exc:  # noqa: BLE001 - the workers may already be gone
            logger.info("worker shutdown: %s", exc)
        self._close_workers(self.workers)
        self._runner.stop()


def _local_rank(addresses: list[str], rank: int) -> int:
    """The rank among the workers on the same host (selects the device there)."""
    host = addresses[rank].rsplit(":", 1)[0]
    return sum(1 for a in addresses[:rank] if a.rsplit(":", 1)[0] == host)


def _local_rendezvous(addresses: list[str]) -> str:
    """A free port on this machine for the workers' torch.distributed rendezvous (rank 0 listens).

    Only valid when rank 0 runs here; for workers elsewhere set ``distributed_init_address``.
    """
    host = addresses[0].rsplit(":", 1)[0]
    if host not in _LOOPBACK:
        raise ConfigError(
            "parallel.distributed_init_address",
            f"worker 0 runs on {host}: give the rendezvous address (--distributed-init-address host:port)",
        )
    return f"127.0.0.1:{free_port()}"


_LOOPBACK = {"127.0.0.1", "localhost", "[::1]", "::1"}


async def _wait_back(address: str, fresh: bool, deadline: float) -> None:
    """Wait until the worker at ``address`` answers health; with ``fresh``, until it is a new process
    (NOT_SERVING: no engine initialized it yet), not a surviving rank of the failed group on its way out."""
    wanted = {"NOT_SERVING"} if fresh else {"NOT_SERVING", "SERVING"}
    status = "UNREACHABLE"
    async with aio_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                response = await stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                status = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
            except grpc.RpcError:
                status = "UNREACHABLE"
            if status in wanted:
                return
            await asyncio.sleep(_RECONNECT_POLL_S)
    raise EngineDeadError(f"worker {address} is not back (health {status})")

_EMPTY_ARGS = {
    "load_model": worker_pb2.LoadModelArgs,
    "determine_available_memory": worker_pb2.DetermineAvailableMemoryArgs,
    "get_kv_cache_spec": worker_pb2.GetKVCacheSpecArgs,
    "check_health": worker_pb2.CheckHealthArgs,
    "shutdown": worker_pb2.ShutdownArgs,
    "list_loras": worker_pb2.ListLorasArgs,
}


def _merge_kv(done: Future, output: Future, output_rank: int) -> None:
    """Complete ``output`` with the output rank's step result, the other ranks' KV transfer reports
    (transfers served whole, bytes moved) added into it."""
    exc = done.exception()
    if exc is not None:
        output.set_exception(exc)
        return
    results = done.result()
    merged = results[output_rank]
    for rank, result in enumerate(results):
        if rank == output_rank or not isinstance(result, ModelRunnerOutput):
            continue
        merged.kv_sent = [*merged.kv_sent, *result.kv_sent]
        merged.kv_bytes_sent += result.kv_bytes_sent
        merged.kv_bytes_received += result.kv_bytes_received
    output.set_result(merged)


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
