"""The Helm chart: lint, schema-valid manifests, the parallel shape, hardening, network edges."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from .tools import CHART, NAMESPACE, RELEASE, REPO, Rendered, helm_run, venv_tool

FULL = f"{RELEASE}-gridserve"
SUFFIX = f"{NAMESPACE}.svc.cluster.local"
EXAMPLE_8_GPU = yaml.safe_load((REPO / "helm" / "examples" / "one-node-8gpu.yaml").read_text())

VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "tp2-dp3-a2": {"tensorParallelSize": 2, "dataParallelSize": 3, "apiServerCount": 2},
    "pp2": {"pipelineParallelSize": 2},
    "tp2-pp2-dp2": {"tensorParallelSize": 2, "pipelineParallelSize": 2, "dataParallelSize": 2},
    "api-key-and-otlp": {"apiKey": {"value": "s3cret"}, "otlp": {"tracesEndpoint": "http://otel.obs:4317"}},
    "existing-api-key-secret": {"apiKey": {"existingSecret": "my-api-key", "secretKey": "key"}},
    "pvc-no-edge-no-metrics": {"model": {"source": "pvc", "pvc": {"claimName": "weights"}, "path": "llama-3-8b"},
                               "edge": {"enabled": False}, "metrics": {"enabled": False}},
    "monitoring-keda-dp2": {"dataParallelSize": 2, "metrics": {"serviceMonitor": {"enabled": True}},
                            "keda": {"enabled": True}},
    "pod-monitors-and-dashboard": {"metrics": {"serviceMonitor": {"enabled": True},
                                               "podMonitors": {"engine": {"enabled": True},
                                                               "worker": {"enabled": True}},
                                               "dashboard": {"enabled": True,
                                                             "annotations": {"grafana_folder": "LLM"}}}},
    "engine-options": {"engine": {"maxModelLen": 4096, "kvCacheMemoryBytes": 8589934592, "seed": 7,
                                  "enablePrefixCaching": False, "workerRecoveryTimeout": 300,
                                  "maxWaitingRequests": 64, "batchInvariant": True}},
    "example-one-node-8gpu": EXAMPLE_8_GPU,
    "lora": {"lora": {"enabled": True, "modules": {"sql": "sql-v2", "chat": "/adapters/chat"}, "maxLoras": 4,
                      "maxCpuLoras": 8, "maxLoraRank": 64, "allowRuntimeUpdating": True,
                      "volume": {"persistentVolumeClaim": {"claimName": "lora-adapters"}}}},
}
# Kinds from CRDs, whose schemas kubernetes-validate does not ship (checked by hand below; the
# monitors against the vendored subset of their CRD schemas in crds/).
CRD_KINDS = {"ScaledObject", "ServiceMonitor", "PodMonitor"}
MONITOR_SCHEMAS = json.loads((Path(__file__).with_name("crds") / "monitoring.coreos.com_v1.json").read_text())
ROLE_PORTS = {"gateway": 50050, "engine": 50051, "coordinator": 50040, "worker": 50061}


def values_health_port(rendered: Rendered) -> int:
    return rendered.values.get("tls", {}).get("healthPort", 8086)


def shape(values: dict[str, Any]) -> tuple[int, int, int, int]:
    tp = values.get("tensorParallelSize", 1)
    pp = values.get("pipelineParallelSize", 1)
    dp = values.get("dataParallelSize", 1)
    return tp, pp, dp, values.get("apiServerCount") or dp


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]


def main_container(workload: dict[str, Any]) -> dict[str, Any]:
    return pod_spec(workload)["containers"][0]


def pod_names(rendered: Rendered, role: str) -> set[str]:
    """Stable pod DNS names (<pod>.<headless service>) of a role's StatefulSets."""
    names = set()
    for sts in rendered.of_kind("StatefulSet"):
        if rendered.role_of(sts) == role:
            service = rendered.named("Service", sts["spec"]["serviceName"])
            assert service["spec"]["clusterIP"] == "None"
            names |= {f"{sts['metadata']['name']}-{i}.{service['metadata']['name']}"
                      for i in range(sts["spec"]["replicas"])}
    return names


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_helm_lint_passes(helm: str, name: str) -> None:
    result = helm_run(helm, "lint", "--strict", str(CHART), values=VALUE_SETS[name])
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_every_rendered_manifest_passes_kubernetes_validate_strict(render_chart, name: str) -> None:
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate is missing: pip install -e '.[test]'")
    rendered = render_chart(VALUE_SETS[name])
    assert rendered.documents
    for document in rendered.documents:
        if document["kind"] in CRD_KINDS:
            continue
        try:
            kubernetes_validate.validate(document, "1.34.0", strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{document['kind']}/{document['metadata']['name']}: {exc}")
    unknown = {d["kind"] for d in rendered.documents} - CRD_KINDS
    assert unknown >= {"Deployment", "StatefulSet", "Service", "NetworkPolicy", "PodDisruptionBudget"}


def test_kubernetes_validate_cli_accepts_the_default_manifest(helm: str, tmp_path) -> None:
    tool = venv_tool("kubernetes-validate")
    if tool is None:
        pytest.skip("kubernetes-validate is missing: pip install -e '.[test]'")
    result = helm_run(helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE)
    assert result.returncode == 0, result.stderr
    manifest = tmp_path / "rendered.yaml"
    manifest.write_text(result.stdout)
    checked = subprocess.run([tool, "--strict", "-k", "1.34.0", "--quiet", str(manifest)],
                                           capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.mark.parametrize("name", ["defaults", "tp2-dp3-a2", "pp2", "tp2-pp2-dp2", "example-one-node-8gpu"])
def test_workload_counts_match_the_parallel_shape(render_chart, name: str) -> None:
    values = VALUE_SETS[name]
    tp, pp, dp, api_servers = shape(values)
    rendered = render_chart(values)

    engines = rendered.by_role("engine")
    assert len(engines) == dp and all(e["kind"] == "StatefulSet" for e in engines)
    assert sum(e["spec"]["replicas"] for e in engines) == dp
    workers = rendered.by_role("worker")
    assert len(workers) == dp * pp, "one StatefulSet per (engine, pipeline stage)"
    assert all(w["spec"]["replicas"] == tp for w in workers)
    assert sum(w["spec"]["replicas"] for w in workers) == dp * pp * tp
    assert len(rendered.by_role("coordinator")) == (1 if dp > 1 else 0)

    (gateway,) = rendered.by_role("gateway")
    (hpa,) = rendered.of_kind("HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == gateway["metadata"]["name"]
    assert hpa["spec"]["minReplicas"] == api_servers
    gpus = sum(main_container(w)["resources"]["limits"]["nvidia.com/gpu"] * w["spec"]["replicas"]
               for w in workers)
    assert gpus == dp * pp * tp


@pytest.mark.parametrize("name", ["defaults", "tp2-dp3-a2", "tp2-pp2-dp2"])
def test_engines_and_gateways_find_each_other_by_stable_dns_names(render_chart, name: str) -> None:
    tp, pp, dp, _ = shape(VALUE_SETS[name])
    rendered = render_chart(VALUE_SETS[name])
    workers = pod_names(rendered, "worker")
    engine_pods = pod_names(rendered, "engine")
    seen_workers: list[str] = []
    for rank in range(dp):
        engine = rendered.named("StatefulSet", f"{FULL}-engine-{rank}")
        env = env_of(main_container(engine))
        addresses = env["GRIDSERVE_WORKERS"].split(",")
        assert len(addresses) == tp * pp
        expected = [f"{FULL}-worker-{rank}-{p}-{t}.{FULL}-worker.{SUFFIX}:50061"
                    for p in range(pp) for t in range(tp)]
        assert addresses == expected, "rank order: pipeline stage major, tensor rank minor"
        for address in addresses:
            host = address.rsplit(":", 1)[0]
            assert host.removesuffix(f".{SUFFIX}") in workers
        seen_workers += addresses
        assert env["GRIDSERVE_TENSOR_PARALLEL_SIZE"] == str(tp)
        assert env["GRIDSERVE_PIPELINE_PARALLEL_SIZE"] == str(pp)
        assert env["GRIDSERVE_DATA_PARALLEL_RANK"] == str(rank)
        rendezvous = env.get("GRIDSERVE_DISTRIBUTED_INIT_ADDRESS")
        assert rendezvous == (expected[0].replace(":50061", ":29500") if tp * pp > 1 else None)
        assert ("GRIDSERVE_COORDINATOR" in env) == (dp > 1)
    assert len(set(seen_workers)) == dp * pp * tp, "no worker serves two engines"

    (gateway,) = rendered.by_role("gateway")
    engines = env_of(main_container(gateway))["GRIDSERVE_ENGINES"].split(",")
    assert [e.rsplit(":", 1)[0].removesuffix(f".{SUFFIX}") for e in engines] == \
        [f"{FULL}-engine-{r}-0.{FULL}-engine" for r in range(dp)]
    assert {e.rsplit(":", 1)[0].removesuffix(f".{SUFFIX}") for e in engines} == engine_pods
    # Peers connect before a pod is ready (the engine drives the workers' model load).
    for service in ("engine", "worker"):
        assert rendered.named("Service", f"{FULL}-{service}")["spec"]["publishNotReadyAddresses"] is True


@pytest.mark.parametrize("name", ["tp2-dp3-a2", "tp2-pp2-dp2"])
def test_each_tp_group_is_required_on_one_node(render_chart, name: str) -> None:
    rendered = render_chart(VALUE_SETS[name])
    for sts in rendered.by_role("worker"):
        spec = pod_spec(sts)
        (term,) = spec["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term["topologyKey"] == "kubernetes.io/hostname"
        pod_labels = sts["spec"]["template"]["metadata"]["labels"]
        selector = term["labelSelector"]["matchLabels"]
        assert selector.items() <= pod_labels.items()
        assert {"gridserve.io/engine-rank", "gridserve.io/pp-rank"} <= selector.keys()
        assert sts["spec"]["podManagementPolicy"] == "Parallel"
        resources = main_container(sts)["resources"]
        assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == 1


def _check_security(where: str, container: dict[str, Any], pod: dict[str, Any]) -> None:
    context = container.get("securityContext", {})
    pod_context = pod.get("securityContext", {})
    assert context.get("runAsNonRoot", pod_context.get("runAsNonRoot")) is True, where
    assert (context.get("runAsUser") or pod_context.get("runAsUser") or 0) > 0, where
    assert context.get("readOnlyRootFilesystem") is True, where
    assert context.get("allowPrivilegeEscalation") is False, where
    assert context.get("capabilities", {}).get("drop") == ["ALL"], where
    assert not context.get("capabilities", {}).get("add"), where


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_every_container_has_probes_resources_and_a_non_root_context(render_chart, name: str) -> None:
    rendered = render_chart(VALUE_SETS[name])
    for workload in rendered.workloads():
        role = rendered.role_of(workload)
        pod = pod_spec(workload)
        assert pod["automountServiceAccountToken"] is False
        assert {"runAsNonRoot", "seccompProfile"} <= pod["securityContext"].keys()
        for container in pod["containers"] + pod.get("initContainers", []):
            where = f"{workload['metadata']['name']}/{container['name']}"
            for key in ("cpu", "memory"):
                assert key in container["resources"]["requests"], where
                assert key in container["resources"]["limits"], where
            _check_security(where, container, pod)
        for container in pod["containers"]:
            where = f"{workload['metadata']['name']}/{container['name']}"
            probes = [container.get(p) for p in ("startupProbe", "readinessProbe", "livenessProbe")]
            assert all(probes), f"{where} lacks a probe"
            if role in ROLE_PORTS:
                port = ROLE_PORTS[role]
                # The plaintext health port (grpc.health.v1 alone): readiness "" and liveness "liveness".
                health = values_health_port(rendered)
                assert [p["grpc"] for p in probes] == [{"port": health}, {"port": health, "service": ""},
                                                       {"port": health, "service": "liveness"}], where
                assert health != port
                startup = container["startupProbe"]
                assert startup["periodSeconds"] * startup["failureThreshold"] >= 20 * 60, \
                    f"{where}: the startup probe must allow model loading"
        mounts = {m["mountPath"] for c in pod["containers"] for m in c.get("volumeMounts", [])}
        assert "/tmp" in mounts, "a read-only root filesystem needs a writable /tmp"


def _ingress_edges(rendered: Rendered) -> set[tuple[str, str, str]]:
    """(from role or '*', to role, port kind) for every NetworkPolicy rule."""
    edges = set()
    port_kinds = {**{p: "grpc" for p in ROLE_PORTS.values()}, 8080: "http", 9090: "metrics"}
    for policy in rendered.of_kind("NetworkPolicy"):
        spec = policy["spec"]
        assert spec["policyTypes"] == ["Ingress"]
        target = spec["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
        for rule in spec["ingress"]:
            ports = [port_kinds[p["port"]] for p in rule.get("ports", [])] or ["any"]
            sources = ["*"]
            if "from" in rule:
                sources = []
                for peer in rule["from"]:
                    labels = peer["podSelector"]["matchLabels"]
                    assert labels["app.kubernetes.io/instance"] == RELEASE
                    assert "namespaceSelector" not in peer
                    sources.append(labels["app.kubernetes.io/component"])
            edges |= {(s, target, k) for s in sources for k in ports}
    return edges


@pytest.mark.parametrize("dp", [1, 3])
def test_network_policy_allows_exactly_the_architecture_edges(render_chart, dp: int) -> None:
    edges = _ingress_edges(render_chart({"dataParallelSize": dp, "metrics": {"enabled": False}}))
    expected = {
        ("*", "edge", "http"),
        ("edge", "gateway", "grpc"),
        ("gateway", "engine", "grpc"),
        ("engine", "worker", "grpc"),
        ("worker", "worker", "any"),  # torch.distributed (NCCL / gloo) between a rank's peers
    }
    if dp > 1:
        expected |= {("coordinator", "engine", "grpc"), ("engine", "coordinator", "grpc"),
                     ("gateway", "coordinator", "grpc")}
    assert edges == expected


def test_network_policy_opens_metrics_only_on_the_metrics_port(render_chart) -> None:
    edges = _ingress_edges(render_chart({}))
    metrics = {e for e in edges if e[2] == "metrics"}
    assert metrics == {("*", role, "metrics") for role in ("gateway", "engine", "worker")}
    assert not [e for e in edges - metrics if e[0] == "*" and e[1] != "edge"]


def test_without_the_edge_the_gateways_are_the_public_api(render_chart) -> None:
    rendered = render_chart(VALUE_SETS["pvc-no-edge-no-metrics"])
    assert not rendered.by_role("edge")
    assert ("*", "gateway", "grpc") in _ingress_edges(rendered)


@pytest.mark.parametrize("name", ["api-key-and-otlp", "existing-api-key-secret", "defaults"])
def test_api_key_and_otlp_reach_the_roles(render_chart, name: str) -> None:
    values = VALUE_SETS[name]
    rendered = render_chart(values)
    (gateway,) = rendered.by_role("gateway")
    env = env_of(main_container(gateway))
    api_key = values.get("apiKey", {})
    if api_key:
        secret_name = api_key.get("existingSecret") or f"{FULL}-api-key"
        key = api_key.get("secretKey", "api-key")
        assert env["GRIDSERVE_API_KEY"] == {"secretKeyRef": {"name": secret_name, "key": key}}
        secrets = [s["metadata"]["name"] for s in rendered.of_kind("Secret") if "-tls-" not in s["metadata"]["name"]]
        assert secrets == ([] if api_key.get("existingSecret") else [secret_name])
        assert "s3cret" not in str(gateway), "the key lives in the Secret only"
    else:
        assert "GRIDSERVE_API_KEY" not in env
        assert all("-tls-" in s["metadata"]["name"] for s in rendered.of_kind("Secret"))
    endpoint = values.get("otlp", {}).get("tracesEndpoint")
    for workload in rendered.workloads():
        if rendered.role_of(workload) in ROLE_PORTS:
            role_env = env_of(main_container(workload))
            assert role_env.get("GRIDSERVE_OTLP_TRACES_ENDPOINT") == endpoint
            assert role_env["GRIDSERVE_METRICS_PORT"] == "9090"


def test_model_from_a_pvc_is_mounted_read_only_and_not_fetched(render_chart) -> None:
    rendered = render_chart(VALUE_SETS["pvc-no-edge-no-metrics"])
    for workload in rendered.workloads():
        if rendered.role_of(workload) in ("gateway", "engine", "worker"):
            pod = pod_spec(workload)
            assert "initContainers" not in pod
            (volume,) = [v for v in pod["volumes"] if v["name"] == "model"]
            assert volume["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
    engine = rendered.named("StatefulSet", f"{FULL}-engine-0")
    assert env_of(main_container(engine))["GRIDSERVE_MODEL"] == "/models/llama-3-8b"


def test_a_hub_model_is_fetched_by_a_torch_free_init_container(render_chart) -> None:
    rendered = render_chart({})
    for workload in rendered.workloads():
        if rendered.role_of(workload) in ("gateway", "engine", "worker"):
            (init,) = pod_spec(workload)["initContainers"]
            assert init["image"].startswith("gridserve-engine:")
            assert env_of(init)["GRIDSERVE_MODEL"] == "Qwen/Qwen2.5-0.5B-Instruct"
            assert env_of(main_container(workload))["HF_HUB_OFFLINE"] == "1"


def test_engine_options_become_environment_variables(render_chart) -> None:
    env = env_of(main_container(render_chart(VALUE_SETS["engine-options"]).named("StatefulSet", f"{FULL}-engine-0")))
    assert env["GRIDSERVE_MAX_MODEL_LEN"] == "4096"
    assert env["GRIDSERVE_KV_CACHE_MEMORY_BYTES"] == "8589934592"
    assert env["GRIDSERVE_SEED"] == "7"
    assert env["GRIDSERVE_MAX_WAITING_REQUESTS"] == "64"
    assert env["GRIDSERVE_NO_PREFIX_CACHING"] == "1"
    assert env["GRIDSERVE_WORKER_RECOVERY_TIMEOUT"] == "300"
    assert env["GRIDSERVE_BATCH_INVARIANT"] == "1"
    assert "GRIDSERVE_MAX_NUM_SEQS" not in env
    default = env_of(main_container(render_chart({}).named("StatefulSet", f"{FULL}-engine-0")))
    assert "GRIDSERVE_BATCH_INVARIANT" not in default


def test_monitoring_objects_target_the_release(render_chart) -> None:
    rendered = render_chart(VALUE_SETS["monitoring-keda-dp2"])
    (monitor,) = rendered.of_kind("ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"]["app.kubernetes.io/instance"] == RELEASE
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    (scaled,) = rendered.of_kind("ScaledObject")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    assert scaled["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                                "name": f"{FULL}-gateway"}
    assert scaled["spec"]["minReplicaCount"] == 2
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    assert "vllm:num_requests_waiting" in trigger["metadata"]["query"]
    assert f'namespace="{NAMESPACE}"' in trigger["metadata"]["query"]
    assert not rendered.of_kind("HorizontalPodAutoscaler"), "KEDA replaces the HPA"
    (gateway,) = rendered.by_role("gateway")
    assert "replicas" not in gateway["spec"], "the autoscaler owns the replica count"


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_monitors_match_the_prometheus_operator_crd_schemas(render_chart, name: str) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    for document in render_chart(VALUE_SETS[name]).documents:
        if document["kind"] in ("ServiceMonitor", "PodMonitor"):
            jsonschema.validate(document, MONITOR_SCHEMAS[document["kind"]])


def test_pod_monitors_scrape_engines_and_workers_and_the_service_monitor_the_rest(render_chart) -> None:
    rendered = render_chart(VALUE_SETS["pod-monitors-and-dashboard"])
    monitors = {m["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"]: m
                for m in rendered.of_kind("PodMonitor")}
    assert set(monitors) == {"engine", "worker"}
    for role, monitor in monitors.items():
        (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
        assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
        ports = {p["name"] for w in rendered.by_role(role) for p in main_container(w)["ports"]}
        assert "metrics" in ports, role
    (service_monitor,) = rendered.of_kind("ServiceMonitor")
    (expression,) = service_monitor["spec"]["selector"]["matchExpressions"]
    assert expression == {"key": "app.kubernetes.io/component", "operator": "NotIn", "values": ["engine", "worker"]}


@pytest.mark.parametrize("values", [{}, {"metrics": {"podMonitors": {"engine": {"enabled": True}},
                                                     "enabled": False}}])
def test_monitors_and_dashboard_are_off_unless_asked_for(render_chart, values) -> None:
    rendered = render_chart(values)
    assert not rendered.of_kind("PodMonitor") and not rendered.of_kind("ServiceMonitor")
    assert [c["metadata"]["name"] for c in rendered.of_kind("ConfigMap")] == [f"{FULL}-edge"]


def test_the_dashboard_configmap_carries_the_dashboard_for_grafanas_sidecar(render_chart) -> None:
    rendered = render_chart(VALUE_SETS["pod-monitors-and-dashboard"])
    config_map = rendered.named("ConfigMap", f"{FULL}-dashboard")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    dashboard = json.loads(config_map["data"]["gridserve.json"])
    assert dashboard == json.loads((CHART / "dashboards" / "gridserve.json").read_text())


def test_gateways_have_a_disruption_budget_and_a_headless_service(render_chart) -> None:
    rendered = render_chart(VALUE_SETS["tp2-dp3-a2"])
    (pdb,) = rendered.of_kind("PodDisruptionBudget")
    (gateway,) = rendered.by_role("gateway")
    assert pdb["spec"]["selector"]["matchLabels"] == gateway["spec"]["selector"]["matchLabels"]
    assert pdb["spec"]["maxUnavailable"] == 1
    headless = rendered.named("Service", f"{FULL}-gateway-headless")
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"] == gateway["spec"]["selector"]["matchLabels"]
    # The edge health-checks each replica itself; its status / console route reaches unready ones.
    assert headless["spec"]["publishNotReadyAddresses"] is True


@pytest.mark.parametrize(("values", "message"), [
    ({"tensorParallelSize": 0}, "at '/tensorParallelSize': minimum: got 0, want 1"),
    ({"dataParallelSize": "two"}, "/dataParallelSize"),
    ({"tensorParalelSize": 2}, "additional properties 'tensorParalelSize' not allowed"),
    ({"model": {"source": "pvc"}}, "/model/pvc"),
    ({"model": {"source": "s3"}}, "/model/source"),
    ({"engine": {"dtype": "fp8"}}, "/engine/dtype"),
    ({"securityContext": {"readOnlyRootFilesystem": False}}, "/securityContext/readOnlyRootFilesystem"),
    ({"otlp": {"tracesEndpoint": "otel:4317"}}, "/otlp/tracesEndpoint"),
])
def test_a_wrong_value_fails_at_install_time_with_a_clear_message(helm: str, values, message: str) -> None:
    result = helm_run(helm, "template", RELEASE, str(CHART), values=values)
    assert result.returncode != 0
    assert "values don't meet the specifications of the schema" in result.stderr
    assert message in result.stderr, result.stderr


def test_images_default_to_the_chart_version_and_can_be_overridden(render_chart) -> None:
    rendered = render_chart(VALUE_SETS["example-one-node-8gpu"])
    images = {rendered.role_of(w): main_container(w)["image"] for w in rendered.workloads()}
    assert images["worker"] == "registry.example.com/llm/gridserve-worker:0.1.0"
    assert images["edge"] == "envoyproxy/envoy:v1.40.0"
    assert all(re.match(r"^[\w./-]+:[\w.-]+$", image) for image in images.values())


def test_the_readme_kubernetes_example_renders_one_8_gpu_node(render_chart) -> None:
    readme = (REPO / "README.md").read_text()
    section = readme.split("## On Kubernetes", 1)[1]
    snippet = section.split("```yaml\n", 1)[1].split("```", 1)[0]
    values = yaml.safe_load(snippet)
    rendered = render_chart(values)
    workers = rendered.by_role("worker")
    assert (values["tensorParallelSize"], values["dataParallelSize"]) == (2, 4)
    assert len(rendered.by_role("engine")) == 4
    assert sum(main_container(w)["resources"]["limits"]["nvidia.com/gpu"] * w["spec"]["replicas"]
               for w in workers) == 8


@pytest.fixture(scope="module")
def role_flags() -> dict[str, str]:
    """``gridserve <role> --help`` of each role: the flags its GRIDSERVE_* variables stand for."""
    helps = {}
    for role in ROLE_PORTS:
        result = subprocess.run([sys.executable, "-m", "gridserve.cli", role, "--help"], capture_output=True,
                                text=True, timeout=120, cwd=REPO)
        assert result.returncode == 0, result.stderr
        helps[role] = result.stdout
    return helps


def test_lora_values_become_engine_options_and_mount_the_adapters_on_engines_and_workers(render_chart) -> None:
    rendered = render_chart(VALUE_SETS["lora"])
    engine = rendered.named("StatefulSet", f"{FULL}-engine-0")
    env = env_of(main_container(engine))
    assert env["GRIDSERVE_ENABLE_LORA"] == "1" and env["GRIDSERVE_ALLOW_RUNTIME_LORA_UPDATING"] == "1"
    assert (env["GRIDSERVE_MAX_LORAS"], env["GRIDSERVE_MAX_CPU_LORAS"], env["GRIDSERVE_MAX_LORA_RANK"]) == ("4", "8", "64")
    assert env["GRIDSERVE_LORA_DIR"] == "/adapters"
    from gridserve.shared.config import parse_lora_modules
    assert parse_lora_modules(env["GRIDSERVE_LORA_MODULES"]) == {"sql": "sql-v2", "chat": "/adapters/chat"}
    for sts in rendered.of_kind("StatefulSet"):
        if rendered.role_of(sts) not in ("engine", "worker"):
            continue
        pod = sts["spec"]["template"]["spec"]
        assert {"name": "lora-adapters", "persistentVolumeClaim": {"claimName": "lora-adapters"}} in pod["volumes"]
        mounts = {m["name"]: m for m in main_container(sts)["volumeMounts"]}
        assert mounts["lora-adapters"]["mountPath"] == "/adapters" and mounts["lora-adapters"]["readOnly"]
    default = env_of(main_container(render_chart({}).named("StatefulSet", f"{FULL}-engine-0")))
    assert not any(name.startswith("GRIDSERVE_") and "LORA" in name for name in default)


@pytest.mark.parametrize("name", ["tp2-pp2-dp2", "api-key-and-otlp", "engine-options", "lora"])
def test_every_gridserve_variable_the_chart_sets_is_a_flag_of_the_role(render_chart, role_flags, name) -> None:
    rendered = render_chart(VALUE_SETS[name])
    for workload in rendered.workloads():
        role = rendered.role_of(workload)
        if role not in ROLE_PORTS:
            continue
        for variable in env_of(main_container(workload)):
            if variable.startswith("GRIDSERVE_"):
                flag = "--" + variable.removeprefix("GRIDSERVE_").lower().replace("_", "-")
                assert re.search(rf"{flag}\b", role_flags[role]), f"gridserve {role} has no {flag} ({variable})"
