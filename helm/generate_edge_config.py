"""Writes the chart's Envoy bootstrap, ``helm/gridserve/files/envoy.json.tpl``, from gridserve/edge.py.

The edge of ``gridserve serve`` and the chart's edge are one config: this script takes
``gridserve.edge.envoy_config()`` and changes only what differs on Kubernetes:

- the gateways (both clusters: health-checked, and the status / console one) are one STRICT_DNS
  endpoint, their headless Service (every ready replica's IP), instead of a static list of addresses;
- the listener binds 0.0.0.0 on ``edge.port``; the transcoder reads the descriptor set that the
  edge pod's init container copies from the gateway image;
- a ``health_check`` filter answers the kubelet's probes of the edge itself on /edge/healthz;
- TLS comes and goes with the values: mutual TLS to the gateways (the edge's certificate from its
  Secret at ``tls.mountPath``; only a gateway certificate of this release's deployment,
  ``gridserve.tlsDeployment``, the roles' ``GRIDSERVE_TLS_DEPLOYMENT``) with ``tls.enabled``, HTTPS
  for clients with ``edge.tls.secretName``; so does CORS (the filter, the virtual host's policy, the
  preflight route) with ``edge.cors.allowedOrigins``;
- ``edge.xffNumTrustedHops``: behind a proxy (an ingress) the client address of the per-client
  limit is the one that many trusted proxies put in ``x-forwarded-for``, not the proxy's own.

Helm fills the ``{{ ... }}`` placeholders (``tpl``). Run it after changing gridserve/edge.py
(tests/deploy fails while the file is stale):

    python helm/generate_edge_config.py
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

TEMPLATE = Path(__file__).resolve().parent / "gridserve" / "files" / "envoy.json.tpl"
DESCRIPTOR_PATH = "/etc/envoy/descriptors/protos.pb"
HTTPS_DIR = "/etc/envoy/https"  # the edge.tls.secretName Secret (tls.crt, tls.key)
HEALTH_PATH = "/edge/healthz"
_HEALTH_CHECK = "type.googleapis.com/envoy.extensions.filters.http.health_check.v3.HealthCheck"
# The deployment the gateways' names are scoped to, as edge.py writes it (a DNS name, so it passes
# edge.py's check); Helm puts <fullname>.<namespace> in its place, in the regex with its dots escaped.
DEPLOYMENT = "deployment-sentinel.invalid"

# Sentinels replaced by Helm expressions once the JSON is written (numbers must stay unquoted).
_PLACEHOLDERS = {
    '"@EDGE_PORT@"': "{{ .Values.edge.port }}",
    '"@GATEWAY_PORT@"': "{{ .Values.gateway.port }}",
    '"@GATEWAY_HOST@"': '"{{ include "gridserve.fullname" . }}-gateway-headless.{{ include "gridserve.svcSuffix" . }}"',
    '"@INTERVAL@"': '"{{ .Values.edge.healthCheckInterval }}"',
    '"@MAX_BODY@"': "{{ .Values.edge.maxRequestBodyBytes | int64 }}",
    '"@MAX_CONNECTIONS@"': "{{ .Values.edge.maxConnections | int64 }}",
    '"@IDLE_TIMEOUT@"': '"{{ .Values.edge.streamIdleTimeout }}"',
    '"@REQUEST_BODY_TIMEOUT@"': '"{{ .Values.edge.requestBodyTimeout }}"',
    '"@CONNECTION_IDLE_TIMEOUT@"': '"{{ .Values.edge.connectionIdleTimeout }}"',
    '"@MAX_REQUESTS_PER_CONNECTION@"': "{{ .Values.edge.maxRequestsPerConnection | int64 }}",
    '"@CLIENT_RATE@"': "{{ .Values.edge.maxRequestsPerClientPerSecond | int64 }}",
    '"@MAX_HEAP@"': "{{ .Values.edge.maxHeapBytes | int64 }}",
    '"@XFF_HOPS@"': "{{ .Values.edge.xffNumTrustedHops | int64 }}",
    '"@CORS_ORIGINS@"': ('[{{- range $i, $o := .Values.edge.cors.allowedOrigins }}{{ if $i }},{{ end }}'
                         '{{ if eq $o "*" }}{"safe_regex":{"regex":".*"}}{{ else }}{"exact":{{ $o | toJson }}}'
                         '{{ end }}{{ end }}]'),
    '"@CORS_METHODS@"': '{{ join "," .Values.edge.cors.allowedMethods | toJson }}',
    '"@CORS_HEADERS@"': '{{ join "," .Values.edge.cors.allowedHeaders | toJson }}',
    # Envoy's breakers are per cluster; the chart's cluster is every replica the HPA may run.
    '"@MAX_REQUESTS@"': "{{ mul .Values.edge.maxRequestsPerGateway .Values.gateway.autoscaling.maxReplicas }}",
    "@TLS_DIR@": '{{ trimSuffix "/" .Values.tls.mountPath }}',
    # In the regex matcher of a gateway instance's name, each dot escaped (JSON text: "\\." is \.);
    # a release name and a namespace have no other character a regex reads.
    DEPLOYMENT.replace(".", r"\\."): r'{{ include "gridserve.tlsDeployment" . | replace "." "\\\\." }}',
    DEPLOYMENT: '{{ include "gridserve.tlsDeployment" . }}',
}
# Parts present only when a value asks for them: (sentinel, the Helm condition).
_CORS_ON = ".Values.edge.cors.allowedOrigins"
_CONDITIONAL = {"@UPSTREAM_TLS@": ".Values.tls.enabled", "@DOWNSTREAM_TLS@": ".Values.edge.tls.secretName",
                "@CORS_POLICY@": _CORS_ON, "@CORS_FILTER@": _CORS_ON, "@PREFLIGHT_ROUTE@": _CORS_ON}


def kubernetes_config() -> dict[str, Any]:
    """``edge.envoy_config()`` adapted to Kubernetes, with sentinels for the chart's values."""
    from gridserve import edge

    config = edge.envoy_config("0.0.0.0", 0, ["gateways:1"], descriptor_set=Path(DESCRIPTOR_PATH),
                               cors=edge.CorsPolicy(("https://values.invalid",)),  # its origins: the values
                               downstream_tls=(f"{HTTPS_DIR}/tls.crt", f"{HTTPS_DIR}/tls.key"),
                               upstream_tls=("@TLS_DIR@/tls.crt", "@TLS_DIR@/tls.key", "@TLS_DIR@/ca.crt"),
                               tls_deployment=DEPLOYMENT)
    (listener,) = config["static_resources"]["listeners"]
    _make_conditional(listener["filter_chains"], "@DOWNSTREAM_TLS@")
    _make_conditional(config["static_resources"]["clusters"], "@UPSTREAM_TLS@")
    listener["address"]["socket_address"]["port_value"] = "@EDGE_PORT@"
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    manager["stream_idle_timeout"] = "@IDLE_TIMEOUT@"
    manager["request_timeout"] = "@REQUEST_BODY_TIMEOUT@"
    manager["xff_num_trusted_hops"] = "@XFF_HOPS@"
    manager["common_http_protocol_options"] = {"idle_timeout": "@CONNECTION_IDLE_TIMEOUT@",
                                               "max_requests_per_connection": "@MAX_REQUESTS_PER_CONNECTION@"}
    for http_filter in manager["http_filters"]:
        if http_filter["name"] == "envoy.filters.http.buffer":
            http_filter["typed_config"]["max_request_bytes"] = "@MAX_BODY@"
        if http_filter["name"] == "envoy.filters.http.local_ratelimit":
            for descriptor in http_filter["typed_config"]["descriptors"]:
                descriptor["token_bucket"].update(max_tokens="@CLIENT_RATE@", tokens_per_fill="@CLIENT_RATE@")
    _cors_when_asked(manager)
    for monitor in config["overload_manager"]["resource_monitors"]:
        if monitor["name"] == edge.HEAP_MONITOR:
            monitor["typed_config"]["max_heap_size_bytes"] = "@MAX_HEAP@"
        else:
            monitor["typed_config"]["max_active_downstream_connections"] = "@MAX_CONNECTIONS@"
    manager["http_filters"].insert(0, {
        "name": "envoy.filters.http.health_check",
        "typed_config": {
            "@type": _HEALTH_CHECK,
            "pass_through_mode": False,
            "headers": [{"name": ":path", "string_match": {"exact": HEALTH_PATH}}],
        },
    })
    for cluster in config["static_resources"]["clusters"]:  # the gateways, with and without health checks
        cluster["type"] = "STRICT_DNS"
        cluster["circuit_breakers"]["thresholds"] = [{key: "@MAX_REQUESTS@" for key in threshold}
                                                    for threshold in cluster["circuit_breakers"]["thresholds"]]
        cluster["load_assignment"]["endpoints"] = [{"lb_endpoints": [{"endpoint": {"address": {
            "socket_address": {"address": "@GATEWAY_HOST@", "port_value": "@GATEWAY_PORT@"}}}}]}]
        for check in cluster.get("health_checks", []):
            check["interval"] = check["no_traffic_interval"] = "@INTERVAL@"
        if "outlier_detection" in cluster:
            cluster["outlier_detection"]["interval"] = "@INTERVAL@"
    return config


_SOCKETS: dict[str, Any] = {}


def _cors_when_asked(manager: dict[str, Any]) -> None:
    """The CORS filter, the virtual host's policy and the preflight route become sentinels
    ``render_template`` wraps in ``{{ if }}``; the policy's lists come from the values."""
    from gridserve import edge

    (host,) = manager["route_config"]["virtual_hosts"]
    policy = host.pop("typed_per_filter_config")[edge.CORS_FILTER]
    policy.update(allow_origin_string_match="@CORS_ORIGINS@", allow_methods="@CORS_METHODS@",
                  allow_headers="@CORS_HEADERS@")
    _SOCKETS["@CORS_POLICY@"] = {edge.CORS_FILTER: policy}
    host_items = list(host.items())
    host.clear()
    host.update({"typed_per_filter_config": "@CORS_POLICY@", **dict(host_items)})
    (cors_filter,) = [i for i, f in enumerate(manager["http_filters"]) if f["name"] == edge.CORS_FILTER]
    (preflight,) = [i for i, r in enumerate(host["routes"]) if "headers" in r["match"]]
    for items, index, sentinel in ((manager["http_filters"], cors_filter, "@CORS_FILTER@"),
                                   (host["routes"], preflight, "@PREFLIGHT_ROUTE@")):
        _SOCKETS[sentinel] = items[index]
        items[index] = sentinel


def _make_conditional(items: list[dict[str, Any]], sentinel: str) -> None:
    """Each item's ``transport_socket`` becomes its first key, a sentinel ``render_template`` wraps
    in ``{{ if }}`` (first: a comma always follows it, whether it is rendered or not)."""
    for i, item in enumerate(items):
        _SOCKETS[sentinel] = item.pop("transport_socket")
        items[i] = {"transport_socket": sentinel, **item}


def render_template() -> str:
    text = json.dumps(kubernetes_config(), indent=2) + "\n"
    for sentinel, condition in _CONDITIONAL.items():
        part = json.dumps(_SOCKETS[sentinel], separators=(",", ":"))
        # A key (``"transport_socket": "@X@",``) or a list item (``"@X@",``), always followed by more.
        text = re.sub(rf'\n( *)("[a-z_]+": )?"{sentinel}",',
                      lambda m, c=condition, t=part: f'\n{m.group(1)}{{{{- if {c} }}}}\n{m.group(1)}'
                                                      f'{m.group(2) or ""}{t},\n{m.group(1)}{{{{- end }}}}', text)
    for sentinel, expression in _PLACEHOLDERS.items():
        text = text.replace(sentinel, expression)
    return text


def main() -> int:
    TEMPLATE.parent.mkdir(parents=True, exist_ok=True)
    TEMPLATE.write_text(render_template())
    print(f"wrote {TEMPLATE}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main())
