"""What the gateway reports: latency as the client sees it, its engines' metrics, request spans and
one log line per request.

``GatewayMetrics`` holds vLLM's client-side histograms (TTFT, inter-token latency, end-to-end
latency), ``vllm:request_success_total`` by finish reason (the gateway knows stop-string stops,
which reach the engine as aborts), ``gridserve:gateway_requests_in_flight`` per engine and
``gridserve:engine_failovers_total`` per dead engine. Its
``/metrics`` also carries every engine's metrics (scraped at collect time with a short timeout,
parsed and merged, labels ``engine`` = the engine's index in ``--engines`` and ``model_name`` =
the served model name), so the edge's ``GET /metrics`` reads like ``vllm serve``'s.

``RequestObservation`` follows one request: a span tree (request, tokenize, stream) when tracing is
on, the metrics when a metrics port is set, and the finished-request log line always.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from gridserve.shared.observability.metrics import (
    ITL_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    fetch_families,
    merge_families,
)
from gridserve.shared.observability.tracing import REQUEST_ID, Tracing
from gridserve.shared.outputs import EngineCoreOutput

logger = logging.getLogger(__name__)

ENGINE_SCRAPE_TIMEOUT_S = 2.0


class _EnginesCollector:
    """Every engine's exposition, merged into the gateway's: ``engines()`` gives, per engine, its
    metrics URL (None when unknown or off) and the label values to stamp on its samples."""

    def __init__(self, engines: Callable[[], list[tuple[Optional[str], dict[str, str]]]]) -> None:
        self.engines = engines

    def collect(self):
        sources = [(fetch_families(url, ENGINE_SCRAPE_TIMEOUT_S), labels)
                   for url, labels in self.engines() if url]
        yield from merge_families(sources)


class GatewayMetrics:
    """The gateway's registry (its own metrics plus its engines')."""

    def __init__(self, model_name: str, registry: Optional[CollectorRegistry] = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=False)
        self.model_name = model_name
        labels = ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              labels, buckets=TTFT_BUCKETS, registry=self.registry).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             labels, buckets=ITL_BUCKETS, registry=self.registry).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", labels,
                             buckets=REQUEST_LATENCY_BUCKETS, registry=self.registry).labels(model_name)
        self._success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                [*labels, "finished_reason"], registry=self.registry)
        self._in_flight = Gauge("gridserve:gateway_requests_in_flight",
                                "Requests this gateway is streaming, per engine.", [*labels, "engine"],
                                registry=self.registry)

        self._failovers = Counter("gridserve:engine_failovers",
                                  "Samples continued on another engine after theirs died, by the dead engine.",
                                  [*labels, "engine"], registry=self.registry)

    def failover(self, engine: str) -> None:
        self._failovers.labels(self.model_name, engine).inc()

    def success(self, finished_reason: str) -> None:
        self._success.labels(self.model_name, finished_reason).inc()

    def in_flight(self, engine: str) -> Gauge:
        return self._in_flight.labels(self.model_name, engine)

    def add_engines(self, engines: Callable[[], list[tuple[Optional[str], dict[str, str]]]]) -> None:
        self.registry.register(_EnginesCollector(engines))


class RequestObservation:
    """One gateway request's spans, metrics and final log line."""

    def __init__(self, request_id: str, traceparent: str, metrics: Optional[GatewayMetrics],
                 tracing: Optional[Tracing]) -> None:
        self.request_id = request_id
        self.metrics = metrics
        self.tracing = tracing
        self.start = time.monotonic()
        self.engine = ""
        self.first_token: Optional[float] = None
        self._last: dict[str, float] = {}  # child id -> time of its last token
        self.span: Any = None
        self._phase: Any = None
        if tracing is not None:
            self.span = tracing.start_span("gateway_request", parent=traceparent, kind=tracing.SpanKind.SERVER,
                                           attributes={REQUEST_ID: request_id})

    @property
    def traceparent(self) -> str:
        """Context for the engine: its request span becomes a child of this gateway span."""
        return Tracing.traceparent(self.span) if self.span is not None else ""

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """A child span around a phase (validation and tokenization, the stream)."""
        if self.span is None:
            yield
            return
        span = self.tracing.start_span(name, parent=self.span)
        try:
            yield
        except BaseException as exc:
            span.set_attribute("error.type", type(exc).__name__)
            raise
        finally:
            span.end()

    def on_engine(self, engine: str) -> None:
        self.engine = engine
        if self.metrics is not None:
            self.metrics.in_flight(engine).inc()

    def on_output(self, output: EngineCoreOutput) -> None:
        """Latency of each step's tokens, as the gateway receives them."""
        if not output.new_token_ids:
            return
        now = time.monotonic()
        last = self._last.get(output.request_id)
        self._last[output.request_id] = now
        if self.first_token is None:
            self.first_token = now
        if self.metrics is None:
            return
        if last is None:
            self.metrics.ttft.observe(now - self.start)
        else:
            self.metrics.itl.observe(now - last)

    def on_sample_finished(self, finish_reason: str) -> None:
        if self.metrics is not None:
            self.metrics.e2e.observe(time.monotonic() - self.start)
            self.metrics.success(finish_reason)

    def end(self, samples: dict[str, Any], num_prompt_tokens: int, error: Optional[BaseException]) -> None:
        """Close the request: unfinished samples count as aborted; one log line; the span ends."""
        reasons = [s.finish_reason or "abort" for s in samples.values()]
        for s in samples.values():
            if s.finish_reason is None:
                self.on_sample_finished("abort")
        if self.metrics is not None and self.engine:
            self.metrics.in_flight(self.engine).dec()
        now = time.monotonic()
        generated = sum(len(s.token_ids) for s in samples.values())
        ttft = (self.first_token - self.start) if self.first_token is not None else None
        outcome = type(error).__name__ if error is not None else ",".join(reasons)
        logger.info(
            "request %s finished (%s): engine %s, prompt %d tokens, generated %d, ttft %s, e2e %.3fs",
            self.request_id, outcome, self.engine or "-", num_prompt_tokens, generated,
            f"{ttft:.3f}s" if ttft is not None else "-", now - self.start,
            extra={"request_id": self.request_id, "engine": self.engine, "finish_reason": outcome,
                   "prompt_tokens": num_prompt_tokens, "generation_tokens": generated,
                   "ttft_s": ttft, "e2e_s": now - self.start},
        )
        if self.span is not None:
            self.span.set_attribute("gen_ai.usage.prompt_tokens", num_prompt_tokens)
            self.span.set_attribute("gen_ai.usage.completion_tokens", generated)
            self.span.set_attribute("gen_ai.response.finish_reasons", reasons)
            if error is not None:
                self.span.set_attribute("error.type", type(error).__name__)
            self.span.end()
