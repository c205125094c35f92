"""``WorkerStream``: the engine's end of one worker's ``CollectiveRPC`` stream, on ``grpc.aio``.

The stream lives on the executor's event loop; the engine's busy loop (a plain thread) calls
``call``, which hands the request to the loop and returns a ``concurrent.futures.Future``. Calls are
written to the stream in order, each with a fresh call id; a reader task matches responses to
calls. When the stream breaks (the worker died, the connection dropped) every pending and later
call fails with ``EngineDeadError`` and ``on_failure`` is told, at once: a killed worker is noticed
as soon as its socket closes, and a hung one by the keepalive pings or the per-call timeout.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any, Optional

import grpc

from gridserve.api.worker.v1 import worker_pb2, worker_pb2_grpc
from gridserve.shared.errors import (
    EngineDeadError,
    FailedPreconditionError,
    InvalidArgumentError,
    PermissionDeniedError,
)
from gridserve.shared.rpc.client import aio_channel
from gridserve.shared.rpc.values import decode
from gridserve.shared.rpc.worker_convert import kv_cache_spec_from_pb, runner_output_from_pb

logger = logging.getLogger(__name__)

_CLOSE = object()


class WorkerStream:
    """One long-lived bidirectional stream to one worker; build it with ``connect`` on the loop."""

    def __init__(self, address: str, channel: grpc.aio.Channel,
                 on_failure: Callable[[Exception], None]) -> None:
        self.address = address
        self.on_failure = on_failure
        self.error: Optional[EngineDeadError] = None
        self._loop = asyncio.get_running_loop()
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[str, Future]] = {}
        self._lock = threading.Lock()  # ``call`` and ``fail`` come from any thread
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._channel = channel
        stub = worker_pb2_grpc.WorkerStub(channel)
        self._call = stub.CollectiveRPC(self._requests())
        self._reader = self._loop.create_task(self._read(), name=f"worker-{address}")

    @classmethod
    async def connect(cls, address: str, connect_timeout: float,
                      on_failure: Callable[[Exception], None]) -> WorkerStream:
        """Wait up to ``connect_timeout`` s for the worker to be reachable, then open the stream."""
        channel = aio_channel(address)
        try:
            await asyncio.wait_for(channel.channel_ready(), connect_timeout)
        except asyncio.TimeoutError:
            await channel.close()
            raise EngineDeadError(f"cannot reach the worker at {address} within {connect_timeout:.0f} s") from None
        return cls(address, channel, on_failure)

    def call(self, method: str, **payload: Any) -> Future:
        """Send one call (``payload``: the method's args message); the future gets its result."""
        future: Future = Future()
        with self._lock:
            if self.error is not None:
                future.set_exception(self.error)
                return future
            call_id = next(self._ids)
            self._pending[call_id] = (method, future)
        request = worker_pb2.CollectiveRPCRequest(call_id=call_id, **{method: payload[method]})
        self._loop.call_soon_threadsafe(self._outbox.put_nowait, request)
        return future

    async def _requests(self) -> AsyncIterator[worker_pb2.CollectiveRPCRequest]:
        while True:
            request = await self._outbox.get()
            if request is _CLOSE:
                return
            yield request

    async def _read(self) -> None:
        try:
            async for response in self._call:
                with self._lock:
                    method, future = self._pending.pop(response.call_id)
                _resolve(self.address, method, response, future)
            reason = "closed the stream"
        except grpc.RpcError as exc:
            reason = f"{exc.code().name}: {exc.details()}"
        self.fail(EngineDeadError(f"worker {self.address} {reason}"))

    def fail(self, error: EngineDeadError) -> None:
        """Fail every pending and later call with ``error`` (idempotent, from any thread)."""
        with self._lock:
            if self.error is not None:
                return
            self.error = error
            pending, self._pending = self._pending, {}
        logger.error("%s", error)
        for _method, future in pending.values():
            future.set_exception(error)
        self.on_failure(error)

    async def close(self) -> None:
        """End the stream (the worker of a parallel group then exits) and the channel."""
        with self._lock:
            if self.error is None:
                self.error = EngineDeadError(f"worker stream to {self.address} closed")
        self._outbox.put_nowait(_CLOSE)
        self._call.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)
        await self._channel.close()


# Typed errors a worker method may raise on purpose, raised again here with the same type.
_TYPED_ERRORS = {cls.__name__: cls for cls in (PermissionDeniedError, FailedPreconditionError)}


def _resolve(address: str, method: str, response: worker_pb2.CollectiveRPCResponse, future: Future) -> None:
    if response.HasField("error"):
        typed = _TYPED_ERRORS.get(response.error.type)
        if typed is not None:
            future.set_exception(typed(f"worker {address}: {response.error.message}"))
        elif response.error.type in ("InvalidArgumentError", "ConfigError"):
            field, _, message = response.error.message.partition(": ")
            future.set_exception(InvalidArgumentError(field, f"{message} (worker {address})"))
        else:
            future.set_exception(
                RuntimeError(f"worker {address} {method}: {response.error.type}: {response.error.message}")
            )
    elif response.HasField("model_runner_output"):
        future.set_result(runner_output_from_pb(response.model_runner_output))
    elif response.HasField("available_memory_bytes"):
        future.set_result(response.available_memory_bytes)
    elif response.HasField("kv_cache_spec"):
        future.set_result(kv_cache_spec_from_pb(response.kv_cache_spec))
    elif response.HasField("value"):
        future.set_result(decode(response.value))
    elif response.HasField("lora_ids"):
        future.set_result(list(response.lora_ids.ids))
    else:
        future.set_result(None)
