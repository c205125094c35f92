"""A test OTLP/gRPC trace receiver on a free loopback port: collects every exported span."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    start_ns: int
    end_ns: int
    attributes: dict = field(default_factory=dict)
    links: list[tuple[str, str]] = field(default_factory=list)  # (trace id, span id)


def _value(any_value):
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        received = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    received.append(ReceivedSpan(
                        service=resource.get("service.name", ""), name=s.name, trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(), parent_span_id=s.parent_span_id.hex(),
                        start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano,
                        attributes={a.key: _value(a.value) for a in s.attributes},
                        links=[(link.trace_id.hex(), link.span_id.hex()) for link in s.links],
                    ))
        with self.lock:
            self.spans.extend(received)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    def __init__(self, service: _TraceService, port: int) -> None:
        self._service = service
        self.endpoint = f"http://127.0.0.1:{port}"

    @property
    def spans(self) -> list[ReceivedSpan]:
        with self._service.lock:
            return list(self._service.spans)

    def wait_for(self, predicate: Callable[[list[ReceivedSpan]], bool], timeout: float = 20.0) -> list[ReceivedSpan]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            spans = self.spans
            if predicate(spans):
                return spans
            time.sleep(0.1)
        return self.spans


@contextlib.contextmanager
def otlp_receiver() -> Iterator[OtlpReceiver]:
    """An OTLP trace receiver on 127.0.0.1 (free port), always stopped on exit."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    service = _TraceService()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield OtlpReceiver(service, port)
    finally:
        server.stop(0).wait()
