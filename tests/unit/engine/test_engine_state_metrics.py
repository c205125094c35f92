"""The engine's readiness state in its metrics (``gridserve:engine_state``, one gauge per state) and
in its load report (``EngineLoad.state``), read from the one ``Readiness``."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gridserve.services.engine.metrics import EngineMetrics
from gridserve.shared.config import GridserveConfig
from gridserve.shared.load import EngineLoad
from gridserve.shared.readiness import Readiness, State


def _states(metrics: EngineMetrics) -> dict[str, float]:
    text = generate_latest(metrics.registry).decode()
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "gridserve:engine_state"]
    return {s.labels["state"]: s.value for s in family.samples}


def test_the_state_gauge_follows_readiness_even_without_a_snapshot():
    readiness = Readiness("engine")
    metrics = EngineMetrics(GridserveConfig(), lambda: None, state=lambda: readiness.state)
    assert _states(metrics) == {s.value: float(s is State.LOADING) for s in State}
    readiness.set(State.READY)
    readiness.set(State.SLEEPING, "sleep level 1")
    assert _states(metrics) == {s.value: float(s is State.SLEEPING) for s in State}
    readiness.set(State.DEAD, "a worker died")  # no snapshot from a dead engine; the state still shows
    assert _states(metrics)["dead"] == 1.0 and sum(_states(metrics).values()) == 1.0


def test_the_load_report_carries_the_state():
    assert EngineLoad(0, 0, 0.0).state == "ready"
    assert EngineLoad(0, 0, 0.0, state="sleeping").state == State.SLEEPING.value
