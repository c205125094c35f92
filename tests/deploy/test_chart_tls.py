"""The chart's mutual TLS: per-role certificates (one per engine, generated or from cert-manager),
mounted read-only into that role only, naming the role in this deployment (``<fullname>.<namespace>``,
the roles' ``GRIDSERVE_TLS_DEPLOYMENT``) and the names its clients dial; another release's or
namespace's certificates name no role here; plaintext only on the health port; kubernetes-validate
--strict with TLS on and off."""

from __future__ import annotations

import base64
import subprocess
from typing import Any

import pytest
import yaml
from cryptography import x509
from cryptography.x509.oid import NameOID

from gridserve.shared.rpc import authz
from gridserve.shared.rpc.authz import identity_of, instance_of

from .test_chart import FULL, ROLE_PORTS, env_of, main_container, pod_spec
from .tools import CHART, NAMESPACE, RELEASE, helm_run, venv_tool

TLS_SETS: dict[str, dict[str, Any]] = {
    "tls-on-dp2-tp2": {"dataParallelSize": 2, "tensorParallelSize": 2},
    "tls-off": {"tls": {"enabled": False}},
    "cert-manager": {"tls": {"certManager": {"issuerRef": {"name": "ca", "kind": "ClusterIssuer"},
                                             "spiffeTrustDomain": "cluster.local"}},
                     "edge": {"tls": {"secretName": "public-cert"}}},
}
TLS_DIR = "/etc/gridserve/tls"
DEPLOYMENT = f"{FULL}.{NAMESPACE}"


def _secret_name(workload: dict[str, Any], role: str) -> str:
    """The TLS Secret a role's pods mount: the role's, an engine's its DP rank's own."""
    rank = workload["metadata"]["labels"].get("gridserve.io/engine-rank") if role == "engine" else None
    return f"{FULL}-tls-{role}" + (f"-{rank}" if rank is not None else "")


def _auth(cn: str, names: list[str], uris: tuple[str, ...] = ()) -> dict[str, list[bytes]]:
    """The verified peer properties gRPC hands authorization for a certificate with these names."""
    return {"transport_security_type": [b"ssl"], "x509_common_name": [cn.encode()],
            "x509_subject_alternative_name": [n.encode() for n in [*names, *uris]]}


@pytest.fixture()
def deployment_of(monkeypatch):
    """``deployment_of(env)``: this process reads its deployment from a pod's variables."""
    def use(env: dict[str, Any]) -> None:
        monkeypatch.setattr(authz, "_deployment", authz._UNSET)
        for name in ("GRIDSERVE_TLS_DEPLOYMENT", "GRIDSERVE_TLS_TRUST_DOMAIN"):
            if name in env:
                monkeypatch.setenv(name, env[name])
            else:
                monkeypatch.delenv(name, raising=False)
    return use


def _decode(secret: dict[str, Any], key: str) -> bytes:
    return base64.b64decode(secret["data"][key])


def _dialed_hosts(rendered) -> dict[str, set[str]]:
    """role -> the host names its clients dial (from the engines' and gateways' address variables)."""
    hosts: dict[str, set[str]] = {"engine": set(), "worker": set(), "coordinator": set()}
    for workload in rendered.workloads():
        env = env_of(main_container(workload))
        for var, role in (("GRIDSERVE_WORKERS", "worker"), ("GRIDSERVE_ENGINES", "engine"),
                          ("GRIDSERVE_COORDINATOR", "coordinator")):
            if isinstance(env.get(var), str):
                hosts[role] |= {a.rpartition(":")[0] for a in env[var].split(",")}
    return hosts


def _matches(host: str, names: list[str]) -> bool:
    for name in names:
        if name == host or (name.startswith("*.") and host.split(".", 1)[1] == name[2:]):
            return True
    return False


def test_generated_certificates_name_their_role_and_the_addresses_clients_dial(render_chart) -> None:
    rendered = render_chart(TLS_SETS["tls-on-dp2-tp2"])
    secrets = {s["metadata"]["name"]: s for s in rendered.of_kind("Secret")}
    ca = x509.load_pem_x509_certificate(_decode(secrets[f"{FULL}-tls-ca"], "tls.crt"))
    dialed = _dialed_hosts(rendered)
    assert dialed["worker"] and dialed["engine"] and dialed["coordinator"]
    assert f"{FULL}-tls-engine" not in secrets  # one per engine (DP rank) instead
    for name, role in (("gateway", "gateway"), ("engine-0", "engine"), ("engine-1", "engine"), ("worker", "worker"),
                       ("coordinator", "coordinator"), ("edge", "edge")):
        secret = secrets[f"{FULL}-tls-{name}"]
        assert secret["metadata"]["annotations"]["gridserve.io/tls-deployment"] == DEPLOYMENT
        cert = x509.load_pem_x509_certificate(_decode(secret, "tls.crt"))
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == role
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.DNSName)
        assert f"{role}.{DEPLOYMENT}.gridserve.internal" in names
        assert f"{role}.gridserve.internal" in names  # what the edge's Envoy matches on a gateway
        if role == "engine":
            assert f"{name}.{DEPLOYMENT}.gridserve.internal" in names
        cert.verify_directly_issued_by(ca)
        assert _decode(secret, "ca.crt") == _decode(secrets[f"{FULL}-tls-ca"], "tls.crt")
        for host in dialed.get(role, ()):
            assert _matches(host, names), f"{role} certificate lacks {host}"


def test_each_role_takes_its_chart_certificate_and_refuses_another_releases(render_chart, helm, deployment_of):
    """With the variables the chart sets, authorization reads each generated certificate as its role
    (an engine's as its rank); a certificate the chart renders for another release or namespace
    names no role here, though its CN and unscoped SAN are the same."""
    rendered = render_chart(TLS_SETS["tls-on-dp2-tp2"])
    secrets = {s["metadata"]["name"]: s for s in rendered.of_kind("Secret")}
    for workload in rendered.workloads():
        role = rendered.role_of(workload)
        if role not in ROLE_PORTS:
            continue
        env = env_of(main_container(workload))
        assert env["GRIDSERVE_TLS_DEPLOYMENT"] == DEPLOYMENT
        deployment_of(env)
        cert = x509.load_pem_x509_certificate(_decode(secrets[_secret_name(workload, role)], "tls.crt"))
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
            x509.DNSName)
        auth = _auth(role, names)
        assert identity_of(auth) == role
        if role == "engine":
            assert instance_of(auth) == _secret_name(workload, role).removeprefix(f"{FULL}-tls-")
    deployment_of({"GRIDSERVE_TLS_DEPLOYMENT": DEPLOYMENT})
    for release, namespace in (("other", NAMESPACE), (RELEASE, "staging")):
        result = helm_run(helm, "template", release, str(CHART), "--namespace", namespace,
                          values=TLS_SETS["tls-on-dp2-tp2"])
        assert result.returncode == 0, result.stderr
        for secret in (d for d in yaml.safe_load_all(result.stdout) if d and d["kind"] == "Secret"):
            if "-tls-" not in secret["metadata"]["name"] or secret["metadata"]["name"].endswith("-tls-ca"):
                continue
            cert = x509.load_pem_x509_certificate(_decode(secret, "tls.crt"))
            names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
                x509.DNSName)
            cn = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value
            assert f"{cn}.gridserve.internal" in names
            assert identity_of(_auth(cn, names)) is None, (release, namespace, secret["metadata"]["name"])


def test_each_role_mounts_only_its_own_secret_read_only_and_is_plaintext_only_on_the_health_port(render_chart):
    for name in ("tls-on-dp2-tp2", "tls-off"):
        rendered = render_chart(TLS_SETS[name])
        tls_on = name != "tls-off"
        for workload in rendered.workloads():
            role = rendered.role_of(workload)
            if role not in ROLE_PORTS and role != "edge":
                continue
            pod, container = pod_spec(workload), main_container(workload)
            secrets = [v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v]
            mounts = {m["mountPath"]: m for m in container.get("volumeMounts", [])}
            if not tls_on:
                assert not secrets and TLS_DIR not in mounts
                continue
            assert secrets == [_secret_name(workload, role)], secrets
            assert mounts[TLS_DIR]["readOnly"] is True
            if role == "edge":
                config = yaml.safe_load(rendered.of_kind("ConfigMap")[0]["data"]["envoy.json"])
                for cluster in config["static_resources"]["clusters"]:
                    assert cluster["transport_socket"]["typed_config"]["common_tls_context"]["tls_certificates"]
                continue
            env = env_of(container)
            assert env["GRIDSERVE_TLS_CERT_FILE"] == f"{TLS_DIR}/tls.crt"
            assert env["GRIDSERVE_TLS_CA_FILE"] == f"{TLS_DIR}/ca.crt"
            assert env["GRIDSERVE_TLS_DEPLOYMENT"] == DEPLOYMENT
            ports = {p["name"]: p["containerPort"] for p in container["ports"]}
            health = int(env["GRIDSERVE_HEALTH_PORT"])
            assert ports["health"] == health and ports["grpc"] == ROLE_PORTS[role] != health
            probed = {p["grpc"]["port"] for p in (container[k] for k in ("startupProbe", "readinessProbe",
                                                                          "livenessProbe"))}
            assert probed == {health}  # the probes' port, the only plaintext gRPC one
        for service in rendered.of_kind("Service"):
            for port in service["spec"]["ports"]:
                if port["name"] == "grpc":
                    assert port.get("appProtocol") == ("https" if tls_on else "kubernetes.io/h2c")


def test_cert_manager_certificates_replace_the_generated_ones(render_chart) -> None:
    rendered = render_chart(TLS_SETS["cert-manager"])
    assert not [s for s in rendered.of_kind("Secret") if "-tls-" in s["metadata"]["name"]]
    certificates = {c["metadata"]["name"]: c["spec"] for c in rendered.of_kind("Certificate")}
    assert set(certificates) == {f"{FULL}-tls-{r}" for r in ("gateway", "engine-0", "worker", "edge")}
    engine = certificates[f"{FULL}-tls-engine-0"]
    assert engine["secretName"] == f"{FULL}-tls-engine-0" and engine["commonName"] == "engine"
    assert {f"engine.{DEPLOYMENT}.gridserve.internal", f"engine-0.{DEPLOYMENT}.gridserve.internal"} <= set(
        engine["dnsNames"])
    assert engine["uris"] == [f"spiffe://cluster.local/ns/{NAMESPACE}/sa/{FULL}-engine-0"]
    assert engine["issuerRef"] == {"name": "ca", "kind": "ClusterIssuer"}
    assert {"server auth", "client auth"} <= set(engine["usages"])
    (edge,) = [w for w in rendered.workloads() if rendered.role_of(w) == "edge"]
    assert main_container(edge)["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    config = yaml.safe_load(rendered.of_kind("ConfigMap")[0]["data"]["envoy.json"])
    chain = config["static_resources"]["listeners"][0]["filter_chains"][0]
    assert "DownstreamTlsContext" in chain["transport_socket"]["typed_config"]["@type"]


def test_spiffe_uris_of_a_release_not_named_gridserve_name_their_roles_and_no_one_elses(
        render_chart, helm, deployment_of) -> None:
    """Release ``gs`` (full name ``gs-gridserve``): its SPIFFE URIs alone name each role and engine
    rank, with the trust domain the chart sets; another namespace's or trust domain's do not."""
    rendered = render_chart(TLS_SETS["cert-manager"])
    certificates = {c["metadata"]["name"]: c["spec"] for c in rendered.of_kind("Certificate")}
    (engine,) = rendered.by_role("engine")
    env = env_of(main_container(engine))
    assert env["GRIDSERVE_TLS_TRUST_DOMAIN"] == "cluster.local"
    deployment_of(env)
    for name, role in (("gateway", "gateway"), ("engine-0", "engine"), ("worker", "worker"), ("edge", "edge")):
        (uri,) = certificates[f"{FULL}-tls-{name}"]["uris"]
        assert identity_of(_auth("", [], (uri,))) == role, uri
        assert identity_of(_auth("", [], (uri.replace(f"/ns/{NAMESPACE}/", "/ns/staging/"),))) is None
        assert identity_of(_auth("", [], (uri.replace("spiffe://cluster.local/", "spiffe://other.example/"),))) is None
    assert instance_of(_auth("", [], tuple(certificates[f"{FULL}-tls-engine-0"]["uris"]))) == "engine-0"


@pytest.mark.parametrize("name", sorted(TLS_SETS))
def test_kubernetes_validate_strict_accepts_tls_on_and_off(helm: str, tmp_path, name: str) -> None:
    tool = venv_tool("kubernetes-validate")
    if tool is None:
        pytest.skip("kubernetes-validate is missing: pip install -e '.[test]'")
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(TLS_SETS[name]))
    result = helm_run(helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, "-f", str(values))
    assert result.returncode == 0, result.stderr
    documents = [d for d in yaml.safe_load_all(result.stdout) if d and d["kind"] != "Certificate"]
    manifest = tmp_path / "rendered.yaml"
    manifest.write_text(yaml.safe_dump_all(documents))
    checked = subprocess.run([tool, "--strict", "-k", "1.34.0", "--quiet", str(manifest)],
                             capture_output=True, text=True, timeout=120)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_torch_distributed_ports_are_open_only_to_the_workers_of_the_same_engine(render_chart) -> None:
    """torch.distributed's rendezvous and gloo cannot take TLS: only a DP rank's own workers reach them."""
    rendered = render_chart({"dataParallelSize": 3, "tensorParallelSize": 2})
    rank_label = "gridserve.io/engine-rank"
    worker_to_worker = []
    for policy in rendered.of_kind("NetworkPolicy"):
        target = policy["spec"]["podSelector"]["matchLabels"]
        for rule in policy["spec"].get("ingress", []):
            for peer in rule.get("from", []):
                labels = peer.get("podSelector", {}).get("matchLabels", {})
                if labels.get("app.kubernetes.io/component") == "worker":
                    worker_to_worker.append((target.get(rank_label), labels.get(rank_label), rule.get("ports")))
    assert sorted(worker_to_worker) == [(str(r), str(r), None) for r in range(3)]
