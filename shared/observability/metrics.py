"""Prometheus helpers: the ``/metrics`` HTTP server of a role, vLLM's histogram buckets, and
reading another role's exposition (the gateway merges its engines' metrics into its own).

Every role keeps its metrics in its own ``CollectorRegistry`` (not the global one) and serves it
on ``--metrics-port``. Names and labels follow vLLM (``vllm:*``, labels ``model_name`` and
``engine``); role-specific extras use the ``gridserve:`` prefix.
"""

from __future__ import annotations

import logging
import urllib.request
from collections.abc import Callable, Iterable
from typing import Optional

import prometheus_client
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)

# No ``*_created`` series (vLLM turns them off too): they double the exposition for no dashboard.
prometheus_client.disable_created_metrics()

# Bucket boundaries of vLLM's histograms (seconds), so dashboards' quantiles read the same.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def one_two_five_buckets(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (token-count histograms, as vLLM)."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return buckets
            buckets.append(m * scale)
        scale *= 10


class MetricsServer:
    """``GET /metrics`` of one registry on ``host:port`` (a daemon thread); ``port=0`` picks one."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        self.server, self._thread = prometheus_client.start_http_server(port, addr=host, registry=registry)
        self.port = self.server.server_address[1]
        logger.info("metrics on http://%s:%d/metrics", host, self.port)

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def start_metrics_server(registry: CollectorRegistry, host: str, port: Optional[int]) -> Optional[MetricsServer]:
    """The role's metrics server, or None when no metrics port was given (metrics off)."""
    if port is None:
        return None
    return MetricsServer(registry, host, port)


def fetch_families(url: str, timeout: float) -> list[Metric]:
    """Parse another role's ``/metrics`` text; an unreachable role yields nothing (logged once per call)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - our own role's URL
            text = resp.read().decode("utf-8")
    except OSError as exc:
        logger.debug("cannot scrape %s: %s", url, exc)
        return []
    return list(text_string_to_metric_families(text))


def merge_families(sources: Iterable[tuple[list[Metric], dict[str, str]]],
                   keep: Callable[[str], bool] = lambda name: True) -> list[Metric]:
    """One family per name from several expositions; each source's samples get its label overrides
    (e.g. ``{"engine": "1", "model_name": "served-name"}``)."""
    merged: dict[str, Metric] = {}
    for families, overrides in sources:
        for family in families:
            if not keep(family.name):
                continue
            target = merged.get(family.name)
            if target is None:
                target = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            for s in family.samples:
                labels = {**s.labels, **{k: v for k, v in overrides.items() if k in s.labels}}
                target.add_sample(s.name, labels, s.value, s.timestamp, s.exemplar)
    return list(merged.values())
