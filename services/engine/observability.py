"""``EngineObserver``: what the engine reports about its requests and steps, off the hot path.

Per step it hands the scheduler's ``StepStats`` to the Prometheus histograms (when a metrics port
is set), logs one line per finished request, and (tracing on) ends each finished request's span
with its queue / prefill / decode children, timed from the request's own timeline. A request's
span starts when it is added, parented to the gateway's ``traceparent``; its own ``traceparent``
goes to the workers with the step plan, so their spans join the same trace.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import Optional

from gridserve.services.engine.executor import Executor
from gridserve.services.engine.metrics import EngineMetrics
from gridserve.services.engine.request import Request
from gridserve.services.engine.scheduler import StepStats
from gridserve.shared.observability.tracing import REQUEST_ID, Tracing

logger = logging.getLogger(__name__)


class EngineObserver:
    """Metrics, request log lines and request spans of one engine (each part optional)."""

    def __init__(self, metrics: Optional[EngineMetrics] = None, tracing: Optional[Tracing] = None,
                 engine: str = "0") -> None:
        self.metrics = metrics
        self.tracing = tracing
        self.engine = engine
        self._wall_offset = time.time() - time.monotonic()  # monotonic -> epoch seconds

    def on_add(self, request: Request) -> None:
        if self.tracing is None:
            return
        span = self.tracing.start_span(
            "llm_request", parent=request.traceparent, start_time=self._wall(request.arrival_time),
            kind=self.tracing.SpanKind.SERVER,
            attributes={REQUEST_ID: request.parent_request_id, "gridserve.engine_request_id": request.request_id,
                        "gridserve.engine": self.engine, "gen_ai.usage.prompt_tokens": request.num_prompt_tokens},
        )
        request.span = span
        request.traceparent = Tracing.traceparent(span)

    def on_step(self, step: StepStats, step_seconds: Optional[float]) -> None:
        if self.metrics is not None:
            self.metrics.record_step(step, step_seconds)
        for request in step.finished:
            self._log_finished(request)
            if request.span is not None:
                self._end_span(request)

    def instrument(self, executor: Executor) -> None:
        """Time each ``execute_model`` round trip (submit to result) into the metrics."""
        if self.metrics is None:
            return
        inner, observe = executor.execute_model, self.metrics.execute_time.observe

        def execute_model(scheduler_output, non_block: bool = False):
            start = time.perf_counter()
            result = inner(scheduler_output, non_block)
            if isinstance(result, Future):
                result.add_done_callback(lambda _: observe(time.perf_counter() - start))
            else:
                observe(time.perf_counter() - start)
            return result

        executor.execute_model = execute_model

    # ---- per finished request ---------------------------------------------------------------------
    def _log_finished(self, request: Request) -> None:
        t = _phases(request)
        reason = request.status.finish_reason
        logger.info(
            "request %s finished (%s): engine %s, prompt %d tokens (%d cached), generated %d, "
            "queue %.3fs, prefill %.3fs, decode %.3fs, total %.3fs, preemptions %d",
            request.parent_request_id, reason.value if reason else request.status.name, self.engine,
            request.num_prompt_tokens, max(request.num_cached_tokens, 0), request.num_output_tokens,
            t["queue"], t["prefill"], t["decode"], t["total"], request.num_preemptions,
            extra={"request_id": request.parent_request_id, "engine_request_id": request.request_id,
                   "engine": self.engine, "finish_reason": reason.value if reason else None,
                   "prompt_tokens": request.num_prompt_tokens, "generation_tokens": request.num_output_tokens,
                   "cached_tokens": max(request.num_cached_tokens, 0), "num_preemptions": request.num_preemptions,
                   "queue_s": t["queue"], "prefill_s": t["prefill"], "decode_s": t["decode"], "total_s": t["total"]},
        )

    def _end_span(self, request: Request) -> None:
        tracing, span = self.tracing, request.span
        end = request.finished_time or time.monotonic()
        scheduled, first = request.scheduled_time, request.first_token_time
        tracing.child_span("queue", span, self._wall(request.arrival_time), self._wall(scheduled or end))
        if scheduled is not None:
            tracing.child_span("prefill", span, self._wall(scheduled), self._wall(first or end))
        if first is not None:
            tracing.child_span("decode", span, self._wall(first), self._wall(end))
        reason = request.status.finish_reason
        span.set_attribute("gen_ai.usage.completion_tokens", request.num_output_tokens)
        span.set_attribute("gen_ai.response.finish_reasons", [reason.value if reason else request.status.name])
        span.set_attribute("gridserve.num_preemptions", request.num_preemptions)
        span.set_attribute("gridserve.num_cached_tokens", max(request.num_cached_tokens, 0))
        span.end(end_time=int(self._wall(end) * 1e9))
        request.span = None

    def _wall(self, monotonic: float) -> float:
        return monotonic + self._wall_offset


def _phases(request: Request) -> dict[str, float]:
    end = request.finished_time or time.monotonic()
    scheduled = request.scheduled_time or end
    first = request.first_token_time or end
    return {"queue": scheduled - request.arrival_time, "prefill": max(first - scheduled, 0.0),
            "decode": max(end - first, 0.0), "total": end - request.arrival_time}
