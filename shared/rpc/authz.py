"""Per-RPC authorization by role: ``RULES`` (one table, as data) and the interceptor that applies it.

With mutual TLS every caller holds a certificate signed by the deployment's CA that names its role:
the common name (``engine``), a DNS SAN ``engine.gridserve.internal`` (what Helm's
``genSignedCert`` can write), or a SPIFFE URI SAN whose last path segment is the role, with or
without a ``gridserve-`` prefix (``spiffe://cluster.local/ns/llm/sa/gridserve-engine``, what
cert-manager's CSI driver issues). ``identity_of`` reads it from the *verified* peer certificate in
``context.auth_context()``, never from metadata (which a client writes itself). A certificate that
names two different roles, or none, is refused.

Every method a server hosts must have a row in ``RULES``; a method without one is refused (fail
closed). Health and reflection stay open. A refusal is PERMISSION_DENIED naming the caller and the
method, logged, and counted in ``gridserve:rpc_denied_total{method,identity}``.

Who calls what: the gateway is a client of the engines' request API and of the coordinator; an
``AsyncLLM`` in remote mode speaks the same request API and presents a ``gateway`` certificate.
Engines drive their workers (``CollectiveRPC``, also for Ray-placed workers, which run the same
worker service) and report to the coordinator (``ReportLoad``, the wave calls); a gateway only
watches it (``WatchLoad``). Envoy (``edge``) is the only client of the gateways
besides ``admin``; native gRPC clients of the public API come through Envoy. ``admin`` is the
operator's identity (CLI, tests): the engine's control RPCs accept only it.

Instances: a certificate may also name one instance of its role, ``<role>-<id>`` (``engine-3``
for DP rank 3, ``gateway-0``), as its CN, a DNS SAN ``engine-3.gridserve.internal`` or the last
segment of its SPIFFE URI (``.../sa/gridserve-engine-3``), next to the role's own name
(``instance_of``). Then the coordinator takes an engine's load and wave calls only for its own rank
(``check_rank``), and an engine keeps each caller's output streams and requests apart
(``stream_owner``): a gateway cannot open, feed or abort another's. ``serve --tls`` issues one
per engine and per gateway (``LocalCA.issue_all(instances=)``); with one certificate per role (the
chart's tls.yaml) every engine may write any rank and gateways share one namespace of
``gateway_id``s.

Without TLS there are no identities: a plaintext role listens only on loopback unless started with
``--insecure-internal`` (``shared.rpc.server``), and even then ``LoopbackAdminInterceptor`` answers
the operator's methods (``OPERATOR_ONLY``: the rows only ``admin`` may call) to loopback peers only.
"""

from __future__ import annotations

import inspect
import ipaddress
import logging
import re
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Optional

import grpc
from prometheus_client.core import CounterMetricFamily

from gridserve.shared.errors import PermissionDeniedError

logger = logging.getLogger(__name__)

ROLES = frozenset({"worker", "engine", "gateway", "coordinator", "edge", "admin"})
DNS_SUFFIX = ".gridserve.internal"

_WORKER = "/gridserve.worker.v1.Worker/"
_ENGINE = "/gridserve.engine.v1.EngineCore/"
_COORDINATOR = "/gridserve.coordinator.v1.Coordinator/"
_GATEWAY = "/gridserve.gateway.v1.Gateway/"

_ENGINE_REQUEST_API = ("AddRequest", "AbortRequests", "StreamOutputs", "GetLoad", "GetInfo", "GetStatus")
_ENGINE_ADMIN_API = ("Sleep", "WakeUp", "ResetPrefixCache", "CollectiveRpc")
_GATEWAY_API = ("Generate", "Complete", "Chat", "Tokenize", "Detokenize", "ListModels", "OpenAIListModels",
                "OpenAICompletions", "OpenAIChatCompletions", "OpenAITokenize", "OpenAIDetokenize",
                "OpenAIHealth", "OpenAIVersion", "GetStatus", "GetConsoleFile", "OpenAIOpenAPI",
                "OpenAIResponses", "OpenAIGetResponse")

# method -> the identities allowed to call it. The one place authorization is decided.
RULES: dict[str, frozenset[str]] = {
    _WORKER + "CollectiveRPC": frozenset({"engine"}),
    **{_ENGINE + m: frozenset({"gateway", "admin"}) for m in _ENGINE_REQUEST_API},
    **{_ENGINE + m: frozenset({"admin"}) for m in _ENGINE_ADMIN_API},
    # Engines write their load and meet at the wave barriers; gateways (and MoE engines) only watch.
    **{_COORDINATOR + m: frozenset({"engine"}) for m in ("ReportLoad", "StartWave", "SyncStep")},
    _COORDINATOR + "WatchLoad": frozenset({"engine", "gateway"}),
    **{_GATEWAY + m: frozenset({"edge", "admin"}) for m in _GATEWAY_API},
}
OPEN_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                 "/grpc.reflection.v1.ServerReflection/")
# The operator's methods (only ``admin`` may call them): a plaintext role has no identities, so it
# answers them only to a caller on its own machine (``LoopbackAdminInterceptor``).
OPERATOR_ONLY = frozenset(method for method, allowed in RULES.items() if allowed == {"admin"})


def _text(values: Iterable[bytes]) -> list[str]:
    return [v.decode(errors="replace") if isinstance(v, bytes) else str(v) for v in values]


def roles_named(auth_context: Mapping[str, Iterable[bytes]]) -> set[str]:
    """Every role the peer's certificate names (CN, DNS SAN, SPIFFE URI SAN)."""
    found = set()
    for cn in _text(auth_context.get("x509_common_name", ())):
        if cn in ROLES:
            found.add(cn)
    names = _text(auth_context.get("x509_subject_alternative_name", ())) + _text(auth_context.get("peer_dns", ()))
    for name in names:
        if name.endswith(DNS_SUFFIX) and name[:-len(DNS_SUFFIX)] in ROLES:
            found.add(name[:-len(DNS_SUFFIX)])
    for uri in _text(auth_context.get("peer_spiffe_id", ())) + [n for n in names if n.startswith("spiffe://")]:
        last = uri.rstrip("/").rsplit("/", 1)[-1].removeprefix("gridserve-")
        if last in ROLES:
            found.add(last)
    return found


def identity_of(auth_context: Mapping[str, Iterable[bytes]]) -> Optional[str]:
    """The one role the verified certificate names, or None (no certificate, none, or several)."""
    if auth_context.get("transport_security_type", [b""])[0] != b"ssl":
        return None
    roles = roles_named(auth_context)
    return next(iter(roles)) if len(roles) == 1 else None


def instance_of(auth_context: Mapping[str, Iterable[bytes]]) -> Optional[str]:
    """The one instance (``engine-3``) of its role the verified certificate names, or None (no TLS,
    no role, or a certificate per role); PermissionDeniedError when it names several."""
    role = identity_of(auth_context)
    if role is None:
        return None
    names = _text(auth_context.get("x509_common_name", ()))
    sans = _text(auth_context.get("x509_subject_alternative_name", ())) + _text(auth_context.get("peer_dns", ()))
    names += [n[:-len(DNS_SUFFIX)] for n in sans if n.endswith(DNS_SUFFIX)]
    names += [uri.rstrip("/").rsplit("/", 1)[-1].removeprefix("gridserve-")
              for uri in _text(auth_context.get("peer_spiffe_id", ())) + [n for n in sans if n.startswith("spiffe://")]]
    pattern = re.compile(rf"{role}-[a-z0-9]+(?:-[a-z0-9]+)*")
    found = sorted({name for name in names if pattern.fullmatch(name)})
    if len(found) > 1:
        raise PermissionDeniedError(f"the {role} certificate names several instances ({', '.join(found)})")
    return found[0] if found else None


def check_rank(context: Any, rank: int) -> None:
    """A call that speaks for DP rank ``rank`` (an engine's load, its wave barrier): with a
    certificate per instance, only ``engine-<rank>`` may make it (PermissionDeniedError)."""
    instance = instance_of(context.auth_context())
    if instance is not None and instance != f"engine-{rank}":
        raise PermissionDeniedError(f"{instance} may not speak for dp_rank {rank} (its certificate is not engine-{rank})")


def stream_owner(context: Any) -> Optional[str]:
    """Whose output streams and requests a caller's calls touch on an engine: its instance
    (``gateway-0``), else its role; None without TLS (one shared namespace, as before)."""
    auth = context.auth_context()
    return instance_of(auth) or identity_of(auth)


def _describe(auth_context: Mapping[str, Iterable[bytes]]) -> str:
    """The caller for a refusal message: its role, or what its certificate says."""
    roles = roles_named(auth_context)
    if len(roles) == 1:
        return next(iter(roles))
    cn = _text(auth_context.get("x509_common_name", ()))
    if roles:
        return f"ambiguous ({', '.join(sorted(roles))})"
    return f"CN={cn[0]}" if cn else "no certificate"


class AuthorizationInterceptor(grpc.aio.ServerInterceptor):
    """Checks every call against ``rules`` with the peer's verified identity; also a Prometheus
    collector of the refusals (register it in the role's registry)."""

    def __init__(self, role: str, rules: Mapping[str, frozenset[str]] = RULES) -> None:
        self.role = role
        self.rules = rules
        self._lock = threading.Lock()
        self.denied: dict[tuple[str, str], int] = {}

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_PREFIXES):
            return handler
        return _guarded(handler, lambda context: self._check(details.method, context))

    def _check(self, method: str, context: Any) -> Optional[str]:
        """None when allowed, else the refusal message (logged and counted)."""
        auth = context.auth_context()
        identity = identity_of(auth)
        allowed = self.rules.get(method)
        if identity is not None and allowed is not None and identity in allowed:
            return None
        caller = identity or _describe(auth)
        why = "no authorization rule for it" if allowed is None else f"allowed: {', '.join(sorted(allowed))}"
        message = f"{caller} may not call {method} on the {self.role} ({why})"
        logger.warning("refused: %s (peer %s)", message, context.peer())
        with self._lock:
            self.denied[(method, caller)] = self.denied.get((method, caller), 0) + 1
        return message

    def collect(self):
        family = CounterMetricFamily("gridserve:rpc_denied", "Calls refused by the authorization table",
                                     labels=["method", "identity"])
        with self._lock:
            for (method, identity), count in self.denied.items():
                family.add_metric([method, identity], count)
        yield family


class LoopbackAdminInterceptor(grpc.aio.ServerInterceptor):
    """A plaintext role's stand-in for authorization: ``OPERATOR_ONLY`` methods (sleep, wake-up,
    prefix-cache reset, ``CollectiveRpc`` weight updates) are refused with PERMISSION_DENIED to
    any peer that is not on this machine's loopback, since without certificates nothing says who
    the caller is. Everything else stays open, as plaintext always was: the roles' request APIs
    are reachable beyond loopback only when the operator said so (``--insecure-internal``)."""

    def __init__(self, role: str, methods: frozenset[str] = OPERATOR_ONLY) -> None:
        self.role = role
        self.methods = methods

    async def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or details.method not in self.methods:
            return handler
        return _guarded(handler, lambda context: self._check(details.method, context))

    def _check(self, method: str, context: Any) -> Optional[str]:
        peer = context.peer()
        if peer_is_loopback(peer):
            return None
        message = (f"{peer} may not call {method} on the {self.role}: without mutual TLS the operator's "
                   "methods answer only callers on this machine (loopback)")
        logger.warning("refused: %s", message)
        return message


def peer_is_loopback(peer: str) -> bool:
    """Whether a gRPC peer string (``ipv4:127.0.0.1:5000``, ``ipv6:[::1]:5000``, ``unix:...``) is
    this machine: a loopback address (an IPv4-mapped one too) or a Unix socket."""
    kind, _, rest = peer.partition(":")
    if kind == "unix":
        return True
    if kind not in ("ipv4", "ipv6"):
        return False
    host = rest.rpartition(":")[0].strip("[]")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def _guarded(handler: Any, check: Callable[[Any], Optional[str]]) -> Any:
    """``handler`` whose behavior first runs ``check(context)`` and aborts with its message."""
    for kind in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
        behavior = getattr(handler, kind)
        if behavior is not None:
            return handler._replace(**{kind: _wrap(behavior, kind.endswith("stream"), check)})
    return handler


def _wrap(behavior: Callable, streams: bool, check: Callable[[Any], Optional[str]]) -> Callable:
    if streams and inspect.isasyncgenfunction(behavior):
        async def guarded_stream(request: Any, context: Any) -> Any:
            refusal = check(context)
            if refusal is not None:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, refusal)
            async for response in behavior(request, context):
                yield response

        return guarded_stream
    if inspect.iscoroutinefunction(behavior):
        async def guarded_async(request: Any, context: Any) -> Any:
            refusal = check(context)
            if refusal is not None:
                await context.abort(grpc.StatusCode.PERMISSION_DENIED, refusal)
            return await behavior(request, context)

        return guarded_async

    def guarded(request: Any, context: Any) -> Any:  # a plain handler, run in the server's pool
        refusal = check(context)
        if refusal is not None:
            context.abort(grpc.StatusCode.PERMISSION_DENIED, refusal)
        return behavior(request, context)

    return guarded
