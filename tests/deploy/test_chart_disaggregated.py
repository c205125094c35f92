"""The chart with ``disaggregated.enabled``: prefill and decode engine StatefulSets, counted from
``disaggregated.prefill.replicas`` / ``decode.replicas``, each engine with its ``GRIDSERVE_KV_ROLE``
and its own workers, one coordinator, the gateways given every engine; decode workers may reach
prefill workers' gRPC port (KV pulls)."""

from __future__ import annotations

import pytest

from .test_chart import env_of, main_container
from .tools import CHART, helm_run

VALUES = {"disaggregated": {"enabled": True, "prefill": {"replicas": 2}, "decode": {"replicas": 3},
                            "kvTransferTimeout": 20}}


def test_prefill_and_decode_engines_are_scaled_separately(render_chart) -> None:
    rendered = render_chart(VALUES)
    engines = sorted(rendered.by_role("engine"), key=lambda s: s["metadata"]["name"])
    roles = [env_of(main_container(e))["GRIDSERVE_KV_ROLE"] for e in engines]
    assert roles == ["kv_producer"] * 2 + ["kv_consumer"] * 3
    assert [e["metadata"]["labels"]["gridserve.io/kv-role"] for e in engines] == roles
    assert all(env_of(main_container(e))["GRIDSERVE_KV_TRANSFER_TIMEOUT"] == "20" for e in engines)
    assert len(rendered.by_role("worker")) == 5 and len(rendered.by_role("coordinator")) == 1
    gateway = env_of(main_container(rendered.by_role("gateway")[0]))
    assert len(gateway["GRIDSERVE_ENGINES"].split(",")) == 5


def test_decode_workers_may_pull_from_prefill_workers(render_chart) -> None:
    policy = next(p for p in render_chart(VALUES).of_kind("NetworkPolicy") if p["metadata"]["name"].endswith("-worker"))
    sources = {peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
               for rule in policy["spec"]["ingress"] for peer in rule.get("from", [])}
    assert sources == {"engine", "worker"}
    plain = next(p for p in render_chart({}).of_kind("NetworkPolicy") if p["metadata"]["name"].endswith("-worker"))
    assert {peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
            for rule in plain["spec"]["ingress"] for peer in rule.get("from", [])} == {"engine"}


@pytest.mark.parametrize("bad", [{"prefill": {"replicas": 0}}, {"colocated": True}])
def test_bad_disaggregated_values_are_refused(helm: str, bad) -> None:
    result = helm_run(helm, "template", "r", str(CHART), values={"disaggregated": {"enabled": True, **bad}})
    assert result.returncode != 0 and "disaggregated" in result.stderr
