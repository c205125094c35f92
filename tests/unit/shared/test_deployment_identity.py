"""Identity is scoped to the deployment: with ``GRIDSERVE_TLS_DEPLOYMENT`` (``--tls-deployment``) a
certificate names a role only through a name of this deployment, a DNS SAN
``<role>[-<id>].<deployment>.gridserve.internal`` or a SPIFFE URI of its namespace and release; a
certificate of another release or namespace signed by the same (shared) CA is refused, whatever the
release is called. Unset, every name counts as before (``test_tls_authz``, ``test_least_privilege``)."""

from __future__ import annotations

import grpc
import pytest

from gridserve.api.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from gridserve.certificates import LocalCA
from gridserve.services.coordinator.load_table import LoadTable
from gridserve.services.coordinator.servicer import CoordinatorServicer
from gridserve.services.coordinator.waves import Waves
from gridserve.shared.errors import ConfigError
from gridserve.shared.readiness import State
from gridserve.shared.rpc import authz
from gridserve.shared.rpc.authz import AuthorizationInterceptor, identity_of, instance_of
from gridserve.shared.rpc.client import make_channel
from gridserve.shared.rpc.server import RpcServer

DEPLOYMENT = "gs-gridserve.llm"  # the chart's <fullname>.<namespace>: release gs, namespace llm
ROLES = ("worker", "engine", "gateway", "coordinator", "edge", "admin")


@pytest.fixture()
def scoped(monkeypatch):
    """This process's deployment is ``DEPLOYMENT`` (read from its variable, as an in-process server does)."""
    monkeypatch.setattr(authz, "_deployment", authz._UNSET)
    monkeypatch.setenv("GRIDSERVE_TLS_DEPLOYMENT", DEPLOYMENT)
    monkeypatch.delenv("GRIDSERVE_TLS_TRUST_DOMAIN", raising=False)
    return monkeypatch


def _ctx(cn: str = "", *sans: str) -> dict:
    auth = {"transport_security_type": [b"ssl"], "x509_subject_alternative_name": [s.encode() for s in sans]}
    if cn:
        auth["x509_common_name"] = [cn.encode()]
    return auth


# ---- the names that count ------------------------------------------------------------------------
@pytest.mark.parametrize("role", ROLES)
def test_a_name_scoped_to_the_deployment_names_the_role(scoped, role):
    assert identity_of(_ctx(role, f"{role}.{DEPLOYMENT}.gridserve.internal", "localhost")) == role
    assert identity_of(_ctx("", f"spiffe://cluster.local/ns/llm/sa/gs-gridserve-{role}")) == role


@pytest.mark.parametrize("role", ROLES)
def test_another_deployments_certificate_names_no_role(scoped, role):
    for other in ("gs-gridserve.staging", "other-gridserve.llm", "gridserve.llm", "gs-gridserve"):
        assert identity_of(_ctx(role, f"{role}.{other}.gridserve.internal", f"{role}.gridserve.internal")) is None


@pytest.mark.parametrize("auth", [
    _ctx("engine"),  # a bare CN
    _ctx("", "engine.gridserve.internal"),  # the unscoped SAN every release's certificate carries
    _ctx("engine", "engine.gridserve.internal", "localhost", "127.0.0.1"),
    _ctx("", "spiffe://cluster.local/ns/llm/sa/gridserve-engine"),  # the prefix the unscoped reading strips
    _ctx("", "spiffe://cluster.local/ns/llm/sa/engine"),
    _ctx("", f"x.engine.{DEPLOYMENT}.gridserve.internal"),  # not a name of this deployment's form
    _ctx("", f"engine.{DEPLOYMENT}.gridserve.internal.evil.com"),
])
def test_unscoped_names_are_refused_when_the_deployment_is_set(scoped, auth):
    assert identity_of(auth) is None


@pytest.mark.parametrize("uri", [
    "spiffe://cluster.local/ns/other/sa/gs-gridserve-engine",  # another namespace
    "spiffe://cluster.local/ns/llm/sa/other-gridserve-engine",  # another release
    "spiffe://cluster.local/ns/llm/sa/gs-gridserve-x-engine",  # a release named gs-gridserve-x
    "spiffe://cluster.local/ns/llm/x/sa/gs-gridserve-engine",
    "spiffe://cluster.local/ns/llm/sa/gs-gridserve-engine/extra",
])
def test_a_spiffe_uri_of_another_namespace_or_release_is_refused(scoped, uri):
    assert identity_of(_ctx("", uri)) is None


@pytest.mark.parametrize("uri, role", [
    ("spiffe://cluster.local/ns/llm/sa/gridserve-engine", "engine"),
    ("spiffe://cluster.local/ns/other/sa/gridserve-engine", None),  # release gridserve of another namespace
    ("spiffe://other.example/ns/llm/sa/gridserve-engine", None),  # another trust domain
    ("spiffe://cluster.local/ns/llm/sa/engine", None),
])
def test_a_release_named_gridserve_takes_spiffe_uris_of_its_namespace_and_trust_domain_only(monkeypatch, uri, role):
    monkeypatch.setattr(authz, "_deployment", authz._UNSET)
    monkeypatch.setenv("GRIDSERVE_TLS_DEPLOYMENT", "gridserve.llm")
    monkeypatch.setenv("GRIDSERVE_TLS_TRUST_DOMAIN", "cluster.local")
    assert identity_of(_ctx("", uri)) == role


def test_a_release_not_named_gridserve_works_with_spiffe(monkeypatch):
    monkeypatch.setattr(authz, "_deployment", authz._UNSET)
    monkeypatch.setenv("GRIDSERVE_TLS_DEPLOYMENT", "chat-llm.prod")
    monkeypatch.setenv("GRIDSERVE_TLS_TRUST_DOMAIN", "cluster.local")
    assert identity_of(_ctx("", "spiffe://cluster.local/ns/prod/sa/chat-llm-engine")) == "engine"
    assert instance_of(_ctx("", "spiffe://cluster.local/ns/prod/sa/chat-llm-engine-2")) == "engine-2"
    assert identity_of(_ctx("", "spiffe://cluster.local/ns/prod/sa/chat-llm-gateway")) == "gateway"
    # the trust domain is checked when set
    assert identity_of(_ctx("", "spiffe://evil.example/ns/prod/sa/chat-llm-engine")) is None
    monkeypatch.delenv("GRIDSERVE_TLS_TRUST_DOMAIN")
    assert identity_of(_ctx("", "spiffe://other.domain/ns/prod/sa/chat-llm-engine")) == "engine"


def test_a_release_whose_name_extends_this_ones_names_no_instance_here(monkeypatch):
    """Release ``a-engine``'s gateway (service account ``a-engine-gateway``) in the namespace of release
    ``a``: not an instance ``engine-gateway`` of a's engine (scoped instance ids are numbers)."""
    monkeypatch.setattr(authz, "_deployment", authz._UNSET)
    monkeypatch.setenv("GRIDSERVE_TLS_DEPLOYMENT", "a.llm")
    assert identity_of(_ctx("", "spiffe://cluster.local/ns/llm/sa/a-engine-gateway")) is None
    assert instance_of(_ctx("", "engine.a.llm.gridserve.internal", "engine-gateway.a.llm.gridserve.internal")) is None


def test_instances_are_read_from_scoped_names_only(scoped):
    auth = _ctx("engine-1", f"engine.{DEPLOYMENT}.gridserve.internal", f"engine-3.{DEPLOYMENT}.gridserve.internal",
                "engine-2.gridserve.internal", "engine-4.other.llm.gridserve.internal")
    assert identity_of(auth) == "engine" and instance_of(auth) == "engine-3"


def test_without_a_deployment_every_name_counts_as_before(monkeypatch):
    monkeypatch.setattr(authz, "_deployment", authz._UNSET)
    monkeypatch.delenv("GRIDSERVE_TLS_DEPLOYMENT", raising=False)
    assert identity_of(_ctx("engine")) == "engine"
    assert identity_of(_ctx("", "spiffe://cluster.local/ns/other/sa/gridserve-engine")) == "engine"
    assert identity_of(_ctx("", f"engine.{DEPLOYMENT}.gridserve.internal")) is None  # not read unscoped


def test_the_configured_deployment_wins_over_the_variable(monkeypatch):
    monkeypatch.setenv("GRIDSERVE_TLS_DEPLOYMENT", "from-env.llm")
    monkeypatch.setattr(authz, "_deployment", authz.Deployment.of(DEPLOYMENT))
    assert identity_of(_ctx("", f"engine.{DEPLOYMENT}.gridserve.internal")) == "engine"
    assert identity_of(_ctx("", "engine.from-env.llm.gridserve.internal")) is None


# ---- configuration ---------------------------------------------------------------------------------
def test_bad_settings_name_their_flag_or_variable(monkeypatch):
    with pytest.raises(ConfigError, match="tls-deployment"):
        authz.Deployment.of("Gridserve_LLM")
    with pytest.raises(ConfigError, match="tls-trust-domain.*needs --tls-deployment"):
        authz.Deployment.of(None, "cluster.local")
    monkeypatch.setattr(authz, "_deployment", authz._UNSET)
    monkeypatch.setenv("GRIDSERVE_TLS_DEPLOYMENT", "has space")
    with pytest.raises(ConfigError, match="GRIDSERVE_TLS_DEPLOYMENT"):
        authz.deployment()


def test_every_role_takes_tls_deployment_and_trust_domain_flags():
    from gridserve.cli import _parser

    for role in ("worker", "engine", "coordinator", "gateway"):
        args = _parser().parse_known_args([role, "--tls-deployment", DEPLOYMENT, "--tls-trust-domain", "td"])[0]
        assert (args.tls_deployment, args.tls_trust_domain) == (DEPLOYMENT, "td"), role


# ---- the refusal, over real mutual TLS -----------------------------------------------------------
def _coordinator(files) -> RpcServer:
    server = RpcServer("127.0.0.1", 0, role="coordinator", tls=files)
    table = LoadTable()
    servicer = CoordinatorServicer(table, Waves(1, on_change=table.bump))
    server.add_service("gridserve.coordinator.v1.Coordinator",
                       lambda s: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, s))
    server.start()
    server.readiness.set(State.READY)
    return server


def _sync_step(address: str, files) -> grpc.RpcError | None:
    with make_channel(address, files) as channel:
        try:
            coordinator_pb2_grpc.CoordinatorStub(channel).SyncStep(coordinator_pb2.SyncStepRequest(), timeout=5)
        except grpc.RpcError as exc:
            return exc
    return None


def test_a_certificate_of_the_same_ca_for_another_deployment_is_refused_saying_why(scoped, tmp_path):
    ca = LocalCA(tmp_path, deployment=DEPLOYMENT)
    server = _coordinator(ca.issue("coordinator"))
    try:
        assert server.deployment == authz.Deployment(DEPLOYMENT)
        outcome = _sync_step(server.address, ca.issue("engine", "engine-here"))
        assert outcome is None or outcome.code() != grpc.StatusCode.PERMISSION_DENIED  # this deployment's
        for name, files in (("another deployment", ca.issue("engine", "engine-other", deployment="gs-gridserve.dev")),
                            ("unscoped", ca.issue("engine", "engine-unscoped", deployment=""))):
            refused = _sync_step(server.address, files)
            assert refused is not None and refused.code() == grpc.StatusCode.PERMISSION_DENIED, name
            assert f"not scoped to this deployment, {DEPLOYMENT}" in refused.details(), name
            assert f"<role>.{DEPLOYMENT}.gridserve.internal" in refused.details(), name
        assert sum(server.authorization.denied.values()) == 2
    finally:
        server.shutdown()


def test_the_refusal_message_names_the_deployment_and_what_a_certificate_here_names(scoped, monkeypatch):
    monkeypatch.setenv("GRIDSERVE_TLS_TRUST_DOMAIN", "cluster.local")
    interceptor = AuthorizationInterceptor("engine")

    class Context:
        def auth_context(self):
            return _ctx("gateway", "gateway.gridserve.internal")

        def peer(self):
            return "ipv4:10.0.0.9:5000"

    message = interceptor._check("/gridserve.engine.v1.EngineCore/AddRequest", Context())
    assert message.startswith("CN=gateway, gateway.gridserve.internal may not call")
    assert ("not scoped to this deployment, gs-gridserve.llm: a certificate here names "
            "<role>.gs-gridserve.llm.gridserve.internal or spiffe://cluster.local/ns/llm/sa/gs-gridserve-<role>") in message
