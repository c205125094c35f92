"""The Grafana dashboard (``helm/gridserve/dashboards/gridserve.json``) queries what gridserve exports.

No Grafana runs here, so the dashboard is checked three ways: its JSON has the shape Grafana's
dashboard model needs (panels with ids, positions, a Prometheus data source variable, targets with
a refId and an expression); every expression parses as PromQL (``promql-parser``, after the Grafana
variables are substituted); and every metric name and label it uses is one the roles really expose
— taken from the gateway's, engine's and worker's Prometheus registries, not from a list.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gridserve.services.engine.metrics import EngineMetrics
from gridserve.services.gateway.observability import GatewayMetrics
from gridserve.services.worker.observability import WorkerObserver
from gridserve.shared.config import GridserveConfig
from gridserve.shared.load import EngineLoad

DASHBOARD = Path(__file__).resolve().parents[2] / "helm" / "gridserve" / "dashboards" / "gridserve.json"
# Labels Prometheus adds to every scraped series (target labels), besides the histograms' le.
TARGET_LABELS = {"instance", "job", "namespace", "pod", "container", "service", "endpoint"}
METRIC = re.compile(r"\b(?:vllm|gridserve):[A-Za-z0-9_]+")
SELECTOR = re.compile(r"\b((?:vllm|gridserve):[A-Za-z0-9_]+)\{([^}]*)\}")
MATCHER = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$model_name": ".*"}
# What the issue asks the dashboard to show: one metric of each.
REQUIRED = ["vllm:request_success_total", "vllm:time_to_first_token_seconds_bucket",
            "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
            "vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
            "vllm:num_preemptions_total", "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total",
            "gridserve:engine_step_seconds_bucket", "gridserve:worker_execute_model_seconds_bucket"]


def exported_series() -> dict[str, set[str]]:
    """Every sample name the roles expose, with its label names (one observation each, so that
    labelled families have a child)."""
    engine = CollectorRegistry(auto_describe=False)
    EngineMetrics(GridserveConfig(), lambda: EngineLoad(1, 2, 0.5, 10, 5, 0), engine="0", registry=engine)
    gateway = GatewayMetrics("model")
    gateway.success("stop")
    gateway.in_flight("0").inc()
    worker = CollectorRegistry()
    WorkerObserver(worker).execute(lambda plan: None, None, rank=0)
    series: dict[str, set[str]] = {}
    for registry in (engine, gateway.registry, worker):
        for family in text_string_to_metric_families(generate_latest(registry).decode()):
            for sample in family.samples:
                series.setdefault(sample.name, set()).update(sample.labels)
    return series


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def expressions(dashboard) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def test_dashboard_has_grafanas_shape(dashboard):
    assert dashboard["uid"] and dashboard["title"] and isinstance(dashboard["schemaVersion"], int)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        position = panel["gridPos"]
        assert position["x"] + position["w"] <= 24 and position["h"] > 0, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert panel["targets"] and len(refs) == len(set(refs)), panel["title"]


def test_every_query_parses_as_promql(expressions):
    promql_parser = pytest.importorskip("promql_parser")
    for expr in expressions:
        for variable, value in GRAFANA_VARIABLES.items():
            expr = expr.replace(variable, value)
        assert "$" not in expr, expr
        promql_parser.parse(expr)


def test_every_metric_and_label_in_the_queries_is_exported(expressions):
    series = exported_series()
    used = {name for expr in expressions for name in METRIC.findall(expr)}
    assert used, "the dashboard queries no gridserve metric"
    assert sorted(used - series.keys()) == [], "metrics the code does not export"
    for expr in expressions:
        for name, matchers in SELECTOR.findall(expr):
            for label in MATCHER.findall(matchers):
                assert label in series[name] | TARGET_LABELS, f"{name} has no label {label}: {expr}"
        labels = set().union(*(series[name] for name in METRIC.findall(expr))) | TARGET_LABELS
        for group in GROUPING.findall(expr):
            for label in filter(None, (x.strip() for x in group.split(","))):
                assert label in labels, f"grouping by {label}, which no metric of the query has: {expr}"


def test_dashboard_covers_requests_latency_engines_and_workers(expressions):
    used = {name for expr in expressions for name in METRIC.findall(expr)}
    assert [m for m in REQUIRED if m not in used] == []
