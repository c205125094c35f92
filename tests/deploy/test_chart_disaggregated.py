"""The chart with ``disaggregated.enabled``: prefill and decode engine StatefulSets, counted from
``disaggregated.prefill.replicas`` / ``decode.replicas``, each engine with its ``GRIDSERVE_KV_ROLE``
and its own workers, one coordinator, the gateways given every engine; decode workers may reach
prefill workers' gRPC port (KV pulls)."""

from __future__ import annotations

import pytest

from .test_chart import FULL, env_of, main_container
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


KEDA = {"keda": {"enabled": True},
        "disaggregated": {"enabled": True, "prefill": {"replicas": 2, "minReplicas": 1, "threshold": "4"},
                          "decode": {"replicas": 3, "minReplicas": 1, "threshold": "16"}}}


def test_keda_scales_each_pool_s_standby_engines_on_its_own_load(render_chart) -> None:
    rendered = render_chart(KEDA)
    scaled = {s["metadata"]["name"]: s for s in rendered.of_kind("ScaledObject")}
    full = FULL
    assert scaled.pop(f"{full}-gateway")["spec"]["scaleTargetRef"]["kind"] == "Deployment"
    # prefill rank 1, decode ranks 3 and 4 (the pools' engines beyond minReplicas), each with its worker
    assert sorted(scaled) == sorted(f"{full}-{kind}-{r}{stage}" for r in (1, 3, 4)
                                    for kind, stage in (("engine", ""), ("worker", "-0")))
    for name, obj in scaled.items():
        spec = obj["spec"]
        assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": name}
        assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (0, 1)
        assert "replicas" not in rendered.named("StatefulSet", name)["spec"], "KEDA owns the replica count"
    prefill = scaled[f"{full}-engine-1"]["spec"]["triggers"][0]["metadata"]
    assert prefill["query"].startswith("sum(vllm:num_requests_waiting{") and prefill["threshold"] == "4"
    assert f'pod=~"{full}-engine-0-0|{full}-engine-1-0"' in prefill["query"]
    decode = [scaled[f"{full}-engine-{r}"]["spec"]["triggers"][0]["metadata"] for r in (3, 4)]
    assert all(d["query"].startswith("sum(vllm:num_requests_running{") for d in decode)
    assert f'pod=~"{full}-engine-2-0|{full}-engine-3-0|{full}-engine-4-0"' in decode[0]["query"]
    assert [float(d["activationThreshold"]) for d in decode] == [16.0, 32.0]  # the j-th standby: j x threshold
    for always_up in (0, 2):
        assert rendered.named("StatefulSet", f"{full}-engine-{always_up}")["spec"]["replicas"] == 1


def test_pools_without_min_replicas_or_without_keda_get_no_engine_scaler(render_chart) -> None:
    assert [s["metadata"]["name"][-8:] for s in render_chart({**VALUES, "keda": {"enabled": True}})
            .of_kind("ScaledObject")] == ["-gateway"]
    assert not render_chart({"disaggregated": KEDA["disaggregated"]}).of_kind("ScaledObject")


def test_a_min_replicas_above_the_pool_is_refused(helm: str) -> None:
    values = {"keda": {"enabled": True},
              "disaggregated": {"enabled": True, "decode": {"replicas": 1, "minReplicas": 2}}}
    result = helm_run(helm, "template", "r", str(CHART), values=values)
    assert result.returncode != 0 and "disaggregated.decode.minReplicas" in result.stderr
