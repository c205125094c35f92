"""``WorkerObserver``: the worker's per-step metrics and spans, wrapped around ``execute_model``.

Metrics (with ``--metrics-port``): ``gridserve:worker_execute_model_seconds`` per rank. Tracing
(with an OTLP endpoint): a ``worker_prefill`` span for the step in which the worker receives a
request (new, or resumed after preemption), a child of the engine's request span (its
``traceparent`` comes with ``NewRequestData``); and one ``execute_model`` span per step, linked to
the engine spans of every request in the batch (a step serves many traces, so it starts its own).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Optional, TypeVar

from prometheus_client import CollectorRegistry, Histogram

from gridserve.shared.observability.metrics import STEP_BUCKETS
from gridserve.shared.observability.tracing import REQUEST_ID, Tracing
from gridserve.shared.scheduler_output import SchedulerOutput

T = TypeVar("T")


class WorkerObserver:
    """Times each step (metrics on) and traces it (tracing on); does nothing else."""

    def __init__(self, registry: Optional[CollectorRegistry] = None, tracing: Optional[Tracing] = None) -> None:
        self.tracing = tracing
        self._step_time = None
        if registry is not None:
            self._step_time = Histogram("gridserve:worker_execute_model_seconds",
                                        "Wall time of one execute_model call on this worker.", ["rank"],
                                        buckets=STEP_BUCKETS, registry=registry)
        self._rank_child: Any = None
        self._request_links: dict[str, Any] = {}  # request id -> a link to its engine span (made once)

    @property
    def enabled(self) -> bool:
        return self._step_time is not None or self.tracing is not None

    def execute(self, run: Callable[[SchedulerOutput], T], plan: SchedulerOutput, rank: int) -> T:
        start = time.perf_counter()
        spans = self._start_step(plan, rank) if self.tracing is not None else ()
        try:
            return run(plan)
        finally:
            for span in spans:
                span.end()
            if self._step_time is not None:
                if self._rank_child is None:
                    self._rank_child = self._step_time.labels(str(rank))
                self._rank_child.observe(time.perf_counter() - start)

    def _start_step(self, plan: SchedulerOutput, rank: int) -> list[Any]:
        """The step's spans: one per request received in it, then the step's own (linked)."""
        tracing, links = self.tracing, self._request_links
        for req_id in plan.finished_req_ids:
            links.pop(req_id, None)
        spans = []
        for new in plan.scheduled_new_reqs:
            context = tracing.span_context(new.traceparent) if new.traceparent else None
            if context is None:
                continue
            links[new.req_id] = tracing.Link(context)
            spans.append(tracing.start_span(
                "worker_prefill", parent=new.traceparent,
                attributes={REQUEST_ID: new.req_id, "gridserve.rank": rank,
                            "gridserve.num_computed_tokens": new.num_computed_tokens,
                            "gridserve.num_scheduled_tokens": plan.num_scheduled_tokens.get(new.req_id, 0),
                            "gridserve.resumed": bool(new.output_token_ids)}))
        step_links = [links[r] for r in plan.num_scheduled_tokens if r in links]
        spans.append(tracing.start_span(
            "execute_model", links=step_links,
            attributes={"gridserve.rank": rank, "gridserve.num_requests": len(plan.num_scheduled_tokens),
                        "gridserve.num_scheduled_tokens": plan.total_num_scheduled_tokens}))
        return spans

    def shutdown(self) -> None:
        self._request_links.clear()
        if self.tracing is not None:
            self.tracing.shutdown()
