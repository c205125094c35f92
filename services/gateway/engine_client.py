"""``EngineClient``: one gateway's connection to one engine.

It keeps the engine's ``StreamOutputs`` stream open (reconnecting after a failure) and hands each
request's outputs to the queue its caller registered. When the stream fails, every registered
request gets ``EngineDeadError`` (UNAVAILABLE for the client) and the engine counts as not ready
until the stream is open again. Every unary call has a deadline.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Optional

import grpc

from gridserve.api.engine.v1 import engine_pb2, engine_pb2_grpc
from gridserve.shared.errors import EngineDeadError
from gridserve.shared.observability.tracing import TRACEPARENT
from gridserve.shared.rpc.client import DEFAULT_DEADLINE_S, make_channel
from gridserve.shared.rpc.convert import engine_output_from_pb, sampling_params_to_pb
from gridserve.shared.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

RECONNECT_DELAY_S = 1.0


class EngineClient:
    """Data-plane client of one engine, shared by all of a gateway's requests."""

    def __init__(self, address: str, gateway_id: str, on_state: Callable[[], None] = lambda: None) -> None:
        self.address = address
        self.gateway_id = gateway_id
        self.on_state = on_state
        self.channel = make_channel(address)
        self.stub = engine_pb2_grpc.EngineCoreStub(self.channel)
        self.ready = threading.Event()
        self._queues: dict[str, queue.SimpleQueue] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._stream: Optional[grpc.Future] = None
        self._metrics_port: Optional[int] = None
        self._thread = threading.Thread(target=self._run, name=f"engine-{address}", daemon=True)
        self._thread.start()

    def info(self, timeout: float = DEFAULT_DEADLINE_S) -> engine_pb2.GetInfoResponse:
        return self.stub.GetInfo(engine_pb2.GetInfoRequest(), timeout=timeout, wait_for_ready=True)

    def load(self) -> engine_pb2.GetLoadResponse:
        return self.stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=DEFAULT_DEADLINE_S)

    def register(self, request_id: str, outputs: queue.SimpleQueue) -> None:
        """Deliver ``request_id``'s ``EngineCoreOutput``s (or an exception) to ``outputs``."""
        with self._lock:
            self._queues[request_id] = outputs

    @property
    def num_in_flight(self) -> int:
        """This gateway's engine requests on this engine now (registered, not yet finished)."""
        return len(self._queues)

    def unregister(self, request_id: str) -> None:
        with self._lock:
            self._queues.pop(request_id, None)

    def add_request(self, request_id: str, token_ids: list[int], params: SamplingParams,
                    parent_request_id: str = "", traceparent: str = "") -> None:
        """``parent_request_id``: the id the client sees; ``traceparent``: the gateway span (W3C),
        sent as gRPC metadata."""
        if not self.ready.is_set():
            raise EngineDeadError(f"engine {self.address} is not reachable")
        self.stub.AddRequest(
            engine_pb2.AddRequestRequest(
                request_id=request_id,
                gateway_id=self.gateway_id,
                prompt_token_ids=token_ids,
                sampling_params=sampling_params_to_pb(params),
                parent_request_id=parent_request_id or None,
            ),
            timeout=DEFAULT_DEADLINE_S,
            metadata=((TRACEPARENT, traceparent),) if traceparent else None,
        )

    def metrics_url(self) -> Optional[str]:
        """The engine's ``/metrics`` URL (asked once with GetInfo), or None when it has none."""
        if self._metrics_port is None:
            try:
                self._metrics_port = self.info(timeout=2.0).metrics_port
            except grpc.RpcError:
                return None
        if not self._metrics_port:
            return None
        host = self.address.rpartition(":")[0]
        return f"http://{host}:{self._metrics_port}/metrics"

    def abort(self, request_ids: list[str]) -> None:
        """Best effort: a failure is logged (the engine may be gone)."""
        try:
            self.stub.AbortRequests(engine_pb2.AbortRequestsRequest(request_ids=request_ids), timeout=5.0)
        except grpc.RpcError as exc:
            logger.info("abort %s on %s failed: %s", request_ids, self.address, exc.code().name)

    def close(self) -> None:
        self._closed.set()
        if self._stream is not None:
            self._stream.cancel()
        self.channel.close()

    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                self._stream = self.stub.StreamOutputs(
                    engine_pb2.StreamOutputsRequest(gateway_id=self.gateway_id), wait_for_ready=True
                )
                for batch in self._stream:
                    if not self.ready.is_set():
                        self.ready.set()
                        self.on_state()
                    self._dispatch(batch)
                reason = "the engine closed the output stream"
            except grpc.RpcError as exc:
                reason = f"{exc.code().name}: {exc.details()}"
            if self._closed.is_set():
                return
            self._fail_all(EngineDeadError(f"engine {self.address}: {reason}"))
            self._closed.wait(RECONNECT_DELAY_S)

    def _dispatch(self, batch: engine_pb2.StreamOutputsResponse) -> None:
        with self._lock:
            for msg in batch.outputs:
                outputs = self._queues.get(msg.request_id)
                if outputs is not None:
                    outputs.put(engine_output_from_pb(msg))

    def _fail_all(self, error: EngineDeadError) -> None:
        if self.ready.is_set():
            logger.warning("%s", error)
        else:
            logger.debug("%s", error)
        self.ready.clear()
        self.on_state()
        with self._lock:
            for outputs in self._queues.values():
                outputs.put(error)
