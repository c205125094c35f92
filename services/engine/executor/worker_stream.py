"""``WorkerStream``: the engine's end of one worker's ``CollectiveRPC`` stream.

Calls are written to the stream in order, each with a fresh call id, and answered through a
``Future``; a reader thread matches responses to calls. When the stream breaks (the worker died,
the connection dropped) every pending and later call fails with ``EngineDeadError`` and
``on_failure`` is told, at once: a killed worker is noticed as soon as its socket closes, and a
hung one by the keepalive pings or the per-call timeout.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Optional

import grpc

from gridserve.api.worker.v1 import worker_pb2, worker_pb2_grpc
from gridserve.shared.errors import EngineDeadError
from gridserve.shared.rpc.client import make_channel
from gridserve.shared.rpc.worker_convert import runner_output_from_pb

logger = logging.getLogger(__name__)

_CLOSE = object()


class WorkerStream:
    """One long-lived bidirectional stream to one worker."""

    def __init__(self, address: str, connect_timeout: float, on_failure: Callable[[Exception], None]) -> None:
        self.address = address
        self.on_failure = on_failure
        self.error: Optional[EngineDeadError] = None
        self._ids = itertools.count(1)
        self._pending: dict[int, tuple[str, Future]] = {}
        self._lock = threading.Lock()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._channel = make_channel(address)
        try:
            grpc.channel_ready_future(self._channel).result(timeout=connect_timeout)
        except grpc.FutureTimeoutError:
            self._channel.close()
            raise EngineDeadError(f"cannot reach the worker at {address} within {connect_timeout:.0f} s") from None
        stub = worker_pb2_grpc.WorkerStub(self._channel)
        self._responses = stub.CollectiveRPC(iter(self._outbox.get, _CLOSE))
        self._reader = threading.Thread(target=self._read, name=f"worker-{address}", daemon=True)
        self._reader.start()

    def call(self, method: str, **payload: Any) -> Future:
        """Send one call (``payload``: the method's args message); the future gets its result."""
        future: Future = Future()
        with self._lock:
            if self.error is not None:
                future.set_exception(self.error)
                return future
            call_id = next(self._ids)
            self._pending[call_id] = (method, future)
        self._outbox.put(worker_pb2.CollectiveRPCRequest(call_id=call_id, **{method: payload[method]}))
        return future

    def _read(self) -> None:
        try:
            for response in self._responses:
                with self._lock:
                    method, future = self._pending.pop(response.call_id)
                _resolve(self.address, method, response, future)
            reason = "closed the stream"
        except grpc.RpcError as exc:
            reason = f"{exc.code().name}: {exc.details()}"
        self.fail(EngineDeadError(f"worker {self.address} {reason}"))

    def fail(self, error: EngineDeadError) -> None:
        """Fail every pending and later call with ``error`` (idempotent)."""
        with self._lock:
            if self.error is not None:
                return
            self.error = error
            pending, self._pending = self._pending, {}
        logger.error("%s", error)
        for _method, future in pending.values():
            future.set_exception(error)
        self.on_failure(error)

    def close(self) -> None:
        with self._lock:
            if self.error is None:
                self.error = EngineDeadError(f"worker stream to {self.address} closed")
        self._outbox.put(_CLOSE)
        self._responses.cancel()
        self._channel.close()


def _resolve(address: str, method: str, response: worker_pb2.CollectiveRPCResponse, future: Future) -> None:
    if response.HasField("error"):
        future.set_exception(
            RuntimeError(f"worker {address} {method}: {response.error.type}: {response.error.message}")
        )
    elif response.HasField("model_runner_output"):
        future.set_result(runner_output_from_pb(response.model_runner_output))
    elif response.HasField("available_memory_bytes"):
        future.set_result(response.available_memory_bytes)
    else:
        future.set_result(None)
