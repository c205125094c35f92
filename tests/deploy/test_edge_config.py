"""The chart's Envoy edge config: generated from gridserve/edge.py, accepted by Envoy."""

from __future__ import annotations

import base64
import copy
import importlib.util
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from gridserve import edge
from gridserve.protos_build import DESCRIPTOR_SET, ensure_generated

from .test_chart import FULL, env_of, main_container
from .tools import CHART, NAMESPACE, RELEASE, REPO, Rendered, helm_run

CHART_DESCRIPTOR = "/etc/envoy/descriptors/protos.pb"
CORS_VALUES = {"allowedOrigins": ["https://app.example", "*"], "allowedMethods": ["GET", "POST"],
               "allowedHeaders": ["authorization", "content-type"]}


def envoy_config(rendered: Rendered) -> dict[str, Any]:
    (config_map,) = rendered.of_kind("ConfigMap")
    return yaml.safe_load(config_map["data"]["envoy.json"])


def connection_manager(config: dict[str, Any]) -> dict[str, Any]:
    (listener,) = config["static_resources"]["listeners"]
    (chain,) = listener["filter_chains"]
    (hcm,) = chain["filters"]
    return hcm["typed_config"]


def normalized_filters(config: dict[str, Any]) -> list[dict[str, Any]]:
    filters = copy.deepcopy(connection_manager(config)["http_filters"])
    for f in filters:
        source = f["typed_config"].get("default_source_code")
        if source:
            source["inline_string"] = source["inline_string"].strip()
    return [f for f in filters if f["name"] != "envoy.filters.http.health_check"]


@pytest.fixture(scope="module")
def descriptor_set() -> Path:
    ensure_generated()
    return DESCRIPTOR_SET


@pytest.mark.parametrize("values", [{}, {"edge": {"port": 9000, "healthCheckInterval": "5s"},
                                         "gateway": {"port": 6000}},
                                    {"tls": {"enabled": False}},
                                    {"edge": {"tls": {"secretName": "public-cert"}}},
                                    {"edge": {"cors": CORS_VALUES}}])
def test_envoy_accepts_the_chart_config(render_chart, descriptor_set: Path, tmp_path: Path, values) -> None:
    from gridserve.certificates import LocalCA

    (config_map,) = render_chart(values).of_kind("ConfigMap")
    text = config_map["data"]["envoy.json"]
    assert CHART_DESCRIPTOR in text
    tls_on = values.get("tls", {}).get("enabled", True)
    https = bool(values.get("edge", {}).get("tls", {}).get("secretName"))
    assert ("/etc/gridserve/tls/tls.crt" in text) == tls_on and ("DownstreamTlsContext" in text) == https
    # The Secrets' files, as mounted in the pod (tls.crt, tls.key, ca.crt), made here for real.
    ca = LocalCA(tmp_path / "tls")
    edge_files = ca.issue("edge")
    for folder in ("tls", "https"):
        (tmp_path / folder).mkdir(exist_ok=True)
        (tmp_path / folder / "tls.crt").write_bytes(edge_files.cert.read_bytes())
        (tmp_path / folder / "tls.key").write_bytes(edge_files.key.read_bytes())
    (tmp_path / "tls" / "ca.crt").write_bytes(ca.ca_pem)
    text = text.replace("/etc/gridserve/tls", str(tmp_path / "tls")).replace("/etc/envoy/https", str(tmp_path / "https"))
    config_file = tmp_path / "envoy.json"
    config_file.write_text(text.replace(CHART_DESCRIPTOR, str(descriptor_set)))
    result = subprocess.run(edge.envoy_argv(config_file, validate=True, log_level="warning"),
                            capture_output=True, text=True, timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "OK" in output
    assert "Deprecated" not in output, output


def _generator():
    path = REPO / "helm" / "generate_edge_config.py"
    spec = importlib.util.spec_from_file_location("generate_edge_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_chart_edge_config_is_up_to_date_with_gridserve_edge() -> None:
    generator = _generator()
    assert generator.TEMPLATE.read_text() == generator.render_template(), \
        "helm/gridserve/files/envoy.json.tpl is stale: run python helm/generate_edge_config.py"


def test_chart_filters_are_those_of_gridserve_edge(render_chart) -> None:
    chart = envoy_config(render_chart({}))
    reference = edge.envoy_config("0.0.0.0", 8080, ["gateway:50050"], descriptor_set=Path(CHART_DESCRIPTOR))
    assert normalized_filters(chart) == normalized_filters(reference)
    names = [f["name"] for f in connection_manager(chart)["http_filters"]]
    assert names[0] == "envoy.filters.http.health_check" and names[-1] == "envoy.filters.http.router"
    for key in ("codec_type", "stream_idle_timeout", "route_config"):
        assert connection_manager(chart)[key] == connection_manager(reference)[key], key
    (deployment,) = render_chart({}).by_role("edge")
    probe = deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
    assert probe["httpGet"]["path"] == _generator().HEALTH_PATH


def test_gateways_are_found_through_their_headless_service(render_chart) -> None:
    rendered = render_chart({"gateway": {"port": 6000}})
    cluster, operator = envoy_config(rendered)["static_resources"]["clusters"]
    reference, _ = edge.envoy_config("0.0.0.0", 8080, ["gateway:6000"])["static_resources"]["clusters"]
    assert operator["load_assignment"]["endpoints"] == cluster["load_assignment"]["endpoints"]
    assert cluster["type"] == "STRICT_DNS"
    (endpoint,) = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    address = endpoint["endpoint"]["address"]["socket_address"]
    assert address == {"address": f"{RELEASE}-gridserve-gateway-headless.{NAMESPACE}.svc.cluster.local",
                       "port_value": 6000}
    headless = rendered.named("Service", f"{RELEASE}-gridserve-gateway-headless")
    assert headless["spec"]["clusterIP"] == "None"
    for key in reference.keys() - {"type", "load_assignment", "health_checks", "outlier_detection",
                                   "circuit_breakers"}:
        assert cluster[key] == reference[key], key
    # The chart sizes the breaker for its most replicas: maxRequestsPerGateway x autoscaling.maxReplicas.
    (breaker,) = cluster["circuit_breakers"]["thresholds"]
    (reference_breaker,) = reference["circuit_breakers"]["thresholds"]
    assert breaker.keys() == reference_breaker.keys() and len(set(breaker.values())) == 1
    (check,) = cluster["health_checks"]
    (reference_check,) = reference["health_checks"]
    assert check.keys() == reference_check.keys() and check["grpc_health_check"] == {}


def test_the_edge_gets_its_descriptor_set_from_the_gateway_image(render_chart) -> None:
    rendered = render_chart({})
    (deployment,) = rendered.by_role("edge")
    pod = deployment["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    (gateway,) = rendered.by_role("gateway")
    assert init["image"] == gateway["spec"]["template"]["spec"]["containers"][0]["image"]
    assert init["command"][-1] == CHART_DESCRIPTOR
    envoy = pod["containers"][0]
    mounts = {m["mountPath"] for m in envoy["volumeMounts"]}
    assert mounts >= {"/etc/envoy/envoy.json", str(Path(CHART_DESCRIPTOR).parent)}
    assert envoy["image"].startswith("envoyproxy/envoy:")


def _gateway_sans(config: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """The SAN matchers of each gateway cluster's upstream TLS (health-checked and operator)."""
    return [c["transport_socket"]["typed_config"]["common_tls_context"]["validation_context"]
            ["match_typed_subject_alt_names"] for c in config["static_resources"]["clusters"]]


def test_the_chart_edge_accepts_only_this_releases_gateways(render_chart, helm) -> None:
    """The edge dials gateways over mutual TLS and takes only a gateway certificate of this
    deployment (<fullname>.<namespace>, the roles' GRIDSERVE_TLS_DEPLOYMENT), as gridserve/edge.py
    writes it; the unscoped gateway.gridserve.internal, which any release's gateway under a shared
    issuer carries, is not accepted."""
    rendered = render_chart({})
    (gateway,) = rendered.by_role("gateway")
    deployment = env_of(main_container(gateway))["GRIDSERVE_TLS_DEPLOYMENT"]
    assert deployment == f"{FULL}.{NAMESPACE}"
    config = envoy_config(rendered)
    scoped = edge.gateway_san_matchers(deployment)
    assert _gateway_sans(config) == [scoped, scoped]
    assert [m["matcher"] for m in scoped] == [
        {"exact": f"gateway.{FULL}.{NAMESPACE}.gridserve.internal"},
        {"safe_regex": {"regex": rf"gateway-[0-9]+\.{FULL}\.{NAMESPACE}\.gridserve\.internal"}}]
    assert edge.GATEWAY_SAN not in yaml.safe_dump(config)
    # The gateways' certificate (the generated Secret) carries the name the edge takes.
    from cryptography import x509

    secret = rendered.named("Secret", f"{FULL}-tls-gateway")
    cert = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["tls.crt"]))
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName)
    assert scoped[0]["matcher"]["exact"] in names
    # Another release in another namespace: its edge takes only its own gateways.
    result = helm_run(helm, "template", "chat", str(CHART), "--namespace", "prod")
    assert result.returncode == 0, result.stderr
    (config_map,) = [d for d in yaml.safe_load_all(result.stdout) if d and d["kind"] == "ConfigMap"]
    other = _gateway_sans(yaml.safe_load(config_map["data"]["envoy.json"]))
    assert other == [edge.gateway_san_matchers("chat-gridserve.prod")] * 2 and other[0] != scoped


def test_chart_cors_is_off_by_default_and_equals_gridserve_edge_when_asked(render_chart) -> None:
    assert edge.CORS_FILTER not in yaml.safe_dump(envoy_config(render_chart({})))  # same-origin only
    chart = envoy_config(render_chart({"edge": {"cors": CORS_VALUES}}))
    policy = edge.CorsPolicy(tuple(CORS_VALUES["allowedOrigins"]), tuple(CORS_VALUES["allowedMethods"]),
                             tuple(CORS_VALUES["allowedHeaders"]))
    reference = edge.envoy_config("0.0.0.0", 8080, ["gateway:50050"], descriptor_set=Path(CHART_DESCRIPTOR),
                                  cors=policy)
    assert normalized_filters(chart) == normalized_filters(reference)
    chart_host, reference_host = (connection_manager(c)["route_config"]["virtual_hosts"][0] for c in (chart, reference))
    assert chart_host["typed_per_filter_config"] == reference_host["typed_per_filter_config"]
    assert [r["match"] for r in chart_host["routes"]] == [r["match"] for r in reference_host["routes"]]


def test_chart_edge_limits_come_from_the_values(render_chart) -> None:
    values = {"requestBodyTimeout": "30s", "connectionIdleTimeout": "45s", "maxRequestsPerConnection": 50,
              "maxRequestsPerClientPerSecond": 20, "maxHeapBytes": 536870912, "xffNumTrustedHops": 1}
    config = envoy_config(render_chart({"edge": values}))
    manager = connection_manager(config)
    assert manager["request_timeout"] == "30s" and manager["xff_num_trusted_hops"] == 1
    assert manager["common_http_protocol_options"] == {"idle_timeout": "45s", "max_requests_per_connection": 50}
    assert manager["use_remote_address"] is True
    (rate_limit,) = [f["typed_config"] for f in manager["http_filters"]
                     if f["name"] == "envoy.filters.http.local_ratelimit"]
    (bucket,) = [d["token_bucket"] for d in rate_limit["descriptors"]]
    assert bucket["max_tokens"] == bucket["tokens_per_fill"] == 20 and bucket["fill_interval"] == "1s"
    overload = config["overload_manager"]
    (heap,) = [m for m in overload["resource_monitors"] if m["name"] == edge.HEAP_MONITOR]
    assert heap["typed_config"]["max_heap_size_bytes"] == 536870912
    assert {a["name"]: a["triggers"][0]["threshold"]["value"] for a in overload["actions"]} == edge.HEAP_ACTIONS
    default = connection_manager(envoy_config(render_chart({})))
    reference = connection_manager(edge.envoy_config("0.0.0.0", 8080, ["gateway:50050"]))
    for key in ("request_timeout", "request_headers_timeout", "common_http_protocol_options", "use_remote_address",
                "xff_num_trusted_hops"):
        assert default[key] == reference[key], key  # the chart's defaults are gridserve serve's
