"""OpenTelemetry tracing of one role, exported over OTLP/gRPC; off unless an endpoint is given.

``Tracing.create(service, endpoint)`` returns None without an endpoint: callers keep that None and
test it once (``if self.tracing is not None``), so with tracing off no OpenTelemetry object exists
and nothing is imported. With an endpoint it owns a ``TracerProvider`` (not the global one) with
a batch span processor; ``shutdown()`` flushes it.

Trace context crosses processes as a W3C ``traceparent`` string: in gRPC metadata from client to
gateway (Envoy passes the HTTP header through) and from gateway to engine, and inside the step
plan from engine to worker (``NewRequestData.traceparent``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, Optional

from gridserve.shared import envs

logger = logging.getLogger(__name__)

TRACEPARENT = "traceparent"
# The request id the client sees, on every role's spans (vLLM's span attribute name).
REQUEST_ID = "gen_ai.request.id"


def traceparent_from_metadata(metadata: Iterable[tuple[str, Any]]) -> str:
    """The ``traceparent`` of gRPC invocation metadata ("" when absent)."""
    for key, value in metadata:
        if key == TRACEPARENT:
            return value if isinstance(value, str) else value.decode("ascii", "replace")
    return ""


def seconds_to_ns(wall_seconds: float) -> int:
    return int(wall_seconds * 1e9)


class Tracing:
    """One role's tracer and the helpers its spans need (parent from / to ``traceparent``)."""

    def __init__(self, service_name: str, endpoint: str, exporter: Any = None) -> None:
        """Spans go to ``endpoint`` in batches; or, given an ``exporter`` (tests), to it one by one."""
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        if exporter is not None:
            self.provider.add_span_processor(SimpleSpanProcessor(exporter))
        else:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

            insecure = not endpoint.startswith("https://")
            self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=insecure)))
        self.tracer = self.provider.get_tracer("gridserve")
        self.SpanKind = trace.SpanKind
        self.Link = trace.Link
        self._trace = trace
        self._propagator = TraceContextTextMapPropagator()
        logger.info("tracing: %s exports spans to %s", service_name, endpoint)

    @classmethod
    def create(cls, service_name: str, endpoint: Optional[str]) -> Optional[Tracing]:
        endpoint = endpoint or envs.flag_default("--otlp-traces-endpoint", "")
        return cls(service_name, endpoint) if endpoint else None

    def context(self, traceparent: str) -> Any:
        """The parent context a ``traceparent`` names (an empty context: a new trace)."""
        return self._propagator.extract({TRACEPARENT: traceparent}) if traceparent else None

    def span_context(self, traceparent: str) -> Any:
        """The remote span context of a ``traceparent`` (for links), or None."""
        ctx = self.context(traceparent)
        if ctx is None:
            return None
        span_context = self._trace.get_current_span(ctx).get_span_context()
        return span_context if span_context.is_valid else None

    def start_span(self, name: str, parent: Any = None, start_time: Optional[float] = None,
                   kind: Any = None, attributes: Optional[dict] = None, links: Any = None) -> Any:
        """A span; ``parent`` is a span, a context or a ``traceparent``; ``start_time`` wall seconds."""
        if isinstance(parent, str):
            parent = self.context(parent)
        elif parent is not None and hasattr(parent, "get_span_context"):
            parent = self._trace.set_span_in_context(parent)
        return self.tracer.start_span(
            name, context=parent, kind=kind or self.SpanKind.INTERNAL, attributes=attributes,
            links=links, start_time=seconds_to_ns(start_time) if start_time is not None else None,
        )

    def child_span(self, name: str, parent: Any, start: float, end: float,
                   attributes: Optional[dict] = None) -> None:
        """A finished child span with explicit wall-clock start and end."""
        span = self.start_span(name, parent, start_time=start, attributes=attributes)
        span.end(end_time=seconds_to_ns(end))

    @staticmethod
    def traceparent(span: Any) -> str:
        """The W3C ``traceparent`` naming ``span`` as the parent."""
        ctx = span.get_span_context()
        return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"

    def shutdown(self) -> None:
        self.provider.shutdown()
