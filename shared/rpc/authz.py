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
per engine and per gateway (``LocalCA.issue_all(instances=)``), the chart's tls.yaml one per
engine; with one certificate per role (the chart's gateways) those instances share one namespace of
``gateway_id``s.

Deployment scope: with ``--tls-deployment`` (``GRIDSERVE_TLS_DEPLOYMENT``; the chart sets
``<fullname>.<namespace>``, ``serve --tls`` a random name) only names scoped to that deployment
count (``Deployment``): a DNS SAN ``<role>[-<id>].<deployment>.gridserve.internal``, or a SPIFFE URI
``spiffe://<trust domain>/ns/<namespace>/sa/<fullname>-<role>[-<id>]`` whose namespace and fullname
are the deployment's (and trust domain ``--tls-trust-domain``, when set); instance ids are then
numbers. A bare CN, an unscoped ``engine.gridserve.internal`` or another deployment's name names
nothing, so a certificate from a CA shared with another release or namespace is refused
(PERMISSION_DENIED saying so). Unset: every name above counts, as the CA signed it.

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
from dataclasses import dataclass
from typing import Any, Optional

import grpc
from prometheus_client.core import CounterMetricFamily

from gridserve.shared import envs
from gridserve.shared.errors import ConfigError, PermissionDeniedError

logger = logging.getLogger(__name__)

ROLES = frozenset({"worker", "engine", "gateway", "coordinator", "edge", "admin"})
DNS_SUFFIX = ".gridserve.internal"

_WORKER = "/gridserve.worker.v1.Worker/"
_ENGINE = "/gridserve.engine.v1.EngineCore/"
_COORDINATOR = "/gridserve.coordinator.v1.Coordinator/"
_GATEWAY = "/gridserve.gateway.v1.Gateway/"

_ENGINE_REQUEST_API = ("AddRequest", "AbortRequests", "StreamOutputs", "GetLoad", "GetInfo", "GetStatus")
# The adapter table (multi-LoRA): every gateway lists it to check model names and build /v1/models,
# and fans the REST edge's load / unload out to every engine (the engine refuses them unless
# --allow-runtime-lora-updating); the operator may call them directly.
_ENGINE_LORA_API = ("LoadLoraAdapter", "UnloadLoraAdapter", "ListLoraAdapters")
_ENGINE_ADMIN_API = ("Sleep", "WakeUp", "ResetPrefixCache", "CollectiveRpc")
_GATEWAY_API = ("Generate", "Complete", "Chat", "Tokenize", "Detokenize", "ListModels", "OpenAIListModels",
                "OpenAICompletions", "OpenAIChatCompletions", "OpenAITokenize", "OpenAIDetokenize",
                "OpenAIHealth", "OpenAIVersion", "GetStatus", "GetConsoleFile", "OpenAIOpenAPI",
                "OpenAIResponses", "OpenAIGetResponse", "OpenAILoadLoraAdapter", "OpenAIUnloadLoraAdapter",
                # pooling models (embeddings, scores, reranking, classification)
                "Embed", "Score", "OpenAIEmbeddings", "OpenAIScore", "OpenAIRerank", "OpenAIClassify")

# method -> the identities allowed to call it. The one place authorization is decided.
RULES: dict[str, frozenset[str]] = {
    _WORKER + "CollectiveRPC": frozenset({"engine"}),
    # Disaggregated prefill / decode: a decode engine's worker pulls KV from a prefill engine's.
    "/gridserve.worker.v1.KVTransfer/PullBlocks": frozenset({"worker"}),
    **{_ENGINE + m: frozenset({"gateway", "admin"}) for m in _ENGINE_REQUEST_API},
    **{_ENGINE + m: frozenset({"gateway", "admin"}) for m in _ENGINE_LORA_API},
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


_SPIFFE = re.compile(r"spiffe://([^/]+)/ns/([^/]+)/sa/([^/]+)")


@dataclass(frozen=True)
class Deployment:
    """The deployment every peer belongs to: ``name`` a DNS name, ``<fullname>.<namespace>`` on
    Kubernetes (the namespace is its last label; a name of one label takes no SPIFFE URI), and the
    SPIFFE ``trust_domain`` a URI must be in (None: any)."""

    name: str
    trust_domain: Optional[str] = None

    @classmethod
    def of(cls, name: Optional[str], trust_domain: Optional[str] = None) -> Optional[Deployment]:
        """From the flags' values (None: no deployment); a bad one is a ConfigError naming its flag."""
        if trust_domain and not name:
            raise ConfigError("tls-trust-domain", "--tls-trust-domain needs --tls-deployment (the deployment "
                                                  "whose names the trust domain scopes)")
        if not name:
            return None
        checked = []
        for flag, value in (("tls-deployment", name), ("tls-trust-domain", trust_domain)):
            try:
                checked.append(envs.dns_name(value) if value else None)
            except ValueError as exc:
                raise ConfigError(flag, f"{exc} (got {value!r})") from None
        return cls(checked[0], checked[1])

    @property
    def dns_suffix(self) -> str:
        """``.<deployment>.gridserve.internal``: what a scoped DNS SAN ends with."""
        return f".{self.name}{DNS_SUFFIX}"

    def names(self, auth_context: Mapping[str, Iterable[bytes]]) -> list[str]:
        """The role and instance names (``engine``, ``engine-3``) the certificate gives itself in this
        deployment: scoped DNS SANs and SPIFFE URIs of its namespace, fullname and trust domain."""
        sans = _sans(auth_context)
        found = [name[:-len(self.dns_suffix)] for name in sans if name.endswith(self.dns_suffix)]
        fullname, _, namespace = self.name.rpartition(".")
        for uri in _uris(auth_context, sans):
            match = _SPIFFE.fullmatch(uri)
            if (match is None or not fullname or match[2] != namespace
                    or (self.trust_domain is not None and match[1] != self.trust_domain)):
                continue
            if match[3].startswith(fullname + "-"):
                found.append(match[3][len(fullname) + 1:])
        return [name for name in found if "." not in name]

    def expected(self, role: str = "<role>") -> str:
        """The names a certificate of ``role`` carries here (for refusal messages)."""
        fullname, _, namespace = self.name.rpartition(".")
        spiffe = f" or spiffe://{self.trust_domain or '<trust domain>'}/ns/{namespace}/sa/{fullname}-{role}"
        return f"{role}{self.dns_suffix}" + (spiffe if fullname else "")


_UNSET: Any = object()
_deployment: Any = _UNSET


def configure(deployment: Optional[Deployment]) -> None:
    """This process's deployment (the role's ``--tls-deployment`` / ``--tls-trust-domain``; None: unscoped)."""
    global _deployment
    _deployment = deployment


def deployment() -> Optional[Deployment]:
    """The configured deployment; until ``configure`` is called, the one ``GRIDSERVE_TLS_DEPLOYMENT``
    and ``GRIDSERVE_TLS_TRUST_DOMAIN`` name, read now (an in-process server, a test)."""
    if _deployment is not _UNSET:
        return _deployment
    return Deployment.of(envs.GRIDSERVE_TLS_DEPLOYMENT, envs.GRIDSERVE_TLS_TRUST_DOMAIN)


def _sans(auth_context: Mapping[str, Iterable[bytes]]) -> list[str]:
    return _text(auth_context.get("x509_subject_alternative_name", ())) + _text(auth_context.get("peer_dns", ()))


def _uris(auth_context: Mapping[str, Iterable[bytes]], sans: list[str]) -> list[str]:
    return _text(auth_context.get("peer_spiffe_id", ())) + [n for n in sans if n.startswith("spiffe://")]


def _unscoped_names(auth_context: Mapping[str, Iterable[bytes]]) -> list[str]:
    """Every role or instance name the certificate gives itself, in any deployment: its CN, DNS SANs
    ``<name>.gridserve.internal``, the last segment of a SPIFFE URI less a ``gridserve-`` prefix."""
    sans = _sans(auth_context)
    names = _text(auth_context.get("x509_common_name", ()))
    names += [n[:-len(DNS_SUFFIX)] for n in sans if n.endswith(DNS_SUFFIX)]
    names += [uri.rstrip("/").rsplit("/", 1)[-1].removeprefix("gridserve-") for uri in _uris(auth_context, sans)]
    return names


def _names(auth_context: Mapping[str, Iterable[bytes]]) -> tuple[list[str], Optional[Deployment]]:
    """The names that count (``Deployment.names`` when scoped, else every one) and the deployment."""
    scope = deployment()
    return (scope.names(auth_context) if scope is not None else _unscoped_names(auth_context)), scope


_SCOPED_INSTANCE = re.compile(r"([a-z]+)-[0-9]+")


def roles_named(auth_context: Mapping[str, Iterable[bytes]]) -> set[str]:
    """Every role the peer's certificate names (CN, DNS SAN, SPIFFE URI SAN; with a deployment, only
    the names scoped to it, where an instance, ``engine-2``, names its role too: a SPIFFE certificate
    carries one URI)."""
    names, scope = _names(auth_context)
    if scope is not None:
        names = [m[1] if (m := _SCOPED_INSTANCE.fullmatch(name)) else name for name in names]
    return {name for name in names if name in ROLES}


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
    names, scope = _names(auth_context)
    # Scoped, an instance id is a number: a SPIFFE service account ``<fullname>-engine-gateway`` of a
    # release named ``<fullname>-engine`` is no instance of this one's engine.
    pattern = re.compile(rf"{role}-[0-9]+" if scope is not None else rf"{role}-[a-z0-9]+(?:-[a-z0-9]+)*")
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
    """The caller for a refusal message and its counter: its role, or what its certificate says."""
    roles = roles_named(auth_context)
    if len(roles) == 1:
        return next(iter(roles))
    if roles:
        return f"ambiguous ({', '.join(sorted(roles))})"
    cn = _text(auth_context.get("x509_common_name", ()))
    if deployment() is not None:
        sans = _sans(auth_context)
        shown = [f"CN={c}" for c in cn] + [n for n in sans if n.endswith(DNS_SUFFIX)] + _uris(auth_context, sans)
        if shown:
            return ", ".join(shown[:3])
    return f"CN={cn[0]}" if cn else "no certificate"


def _scope_refusal(auth_context: Mapping[str, Iterable[bytes]]) -> Optional[str]:
    """Why a certificate that names no role of this deployment is refused (None: unscoped, or it does)."""
    scope = deployment()
    if scope is None or roles_named(auth_context):
        return None
    return (f"its names are not scoped to this deployment, {scope.name}: a certificate here names "
            f"{scope.expected()}")


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
        if identity is None and (scope := _scope_refusal(auth)) is not None:
            message += f"; {scope}"
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
