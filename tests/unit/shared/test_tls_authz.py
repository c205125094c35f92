"""Mutual TLS and authorization pieces, in process with real certificates: identity from the verified
certificate, the one authorization table, client channels that follow rotation, the plaintext health
port, the plaintext warning, the engine's own request checks."""

from __future__ import annotations

import argparse
import logging
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from gridserve.api.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from gridserve.api.engine.v1 import engine_pb2
from gridserve.api.gateway.v1 import gateway_pb2
from gridserve.api.worker.v1 import worker_pb2
from gridserve.certificates import LocalCA
from gridserve.launcher import free_port
from gridserve.services.coordinator.load_table import LoadTable
from gridserve.services.coordinator.servicer import CoordinatorServicer
from gridserve.services.coordinator.waves import Waves
from gridserve.services.engine.request_checks import check_request
from gridserve.shared.errors import ConfigError, InvalidArgumentError
from gridserve.shared.readiness import State
from gridserve.shared.rpc.authz import RULES, identity_of
from gridserve.shared.rpc.client import aio_channel, health_status, make_channel
from gridserve.shared.rpc.loop_thread import LoopThread
from gridserve.shared.rpc.server import RpcServer
from gridserve.shared.rpc.tls import TlsFiles, configure
from gridserve.shared.sampling_params import SamplingParams


def _ctx(**props) -> dict:
    return {"transport_security_type": [b"ssl"], **{k: [v.encode() for v in vs] for k, vs in props.items()}}


@pytest.mark.parametrize("props, expected", [
    ({"x509_common_name": ["engine"]}, "engine"),
    ({"x509_subject_alternative_name": ["gateway.gridserve.internal", "10.0.0.3"]}, "gateway"),
    ({"x509_subject_alternative_name": ["spiffe://cluster.local/ns/llm/sa/gridserve-worker"]}, "worker"),
    ({"peer_spiffe_id": ["spiffe://example.org/admin"]}, "admin"),
    ({"x509_common_name": ["engine"], "x509_subject_alternative_name": ["engine.gridserve.internal"]}, "engine"),
    ({"x509_common_name": ["engine"], "x509_subject_alternative_name": ["gateway.gridserve.internal"]}, None),
    ({"x509_common_name": ["someone"], "x509_subject_alternative_name": ["evil.example.com"]}, None),
    ({"x509_subject_alternative_name": ["gateway.gridserve.internal.evil.com"]}, None),
])
def test_identity_is_the_one_role_the_certificate_names(props, expected):
    assert identity_of(_ctx(**props)) == expected


def test_no_tls_no_identity():
    assert identity_of({"transport_security_type": [b"insecure"], "x509_common_name": [b"admin"]}) is None
    assert identity_of({}) is None


def test_the_table_covers_every_method_and_keeps_admin_rpcs_for_admin():
    for module in (worker_pb2, engine_pb2, coordinator_pb2, gateway_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                assert f"/{service.full_name}/{method.name}" in RULES, method.full_name
    engine = "/gridserve.engine.v1.EngineCore/"
    for method in ("Sleep", "WakeUp", "ResetPrefixCache", "CollectiveRpc"):
        assert RULES[engine + method] == {"admin"}
    for method in ("AddRequest", "AbortRequests", "StreamOutputs", "GetLoad"):
        assert RULES[engine + method] == {"gateway", "admin"}
    for method in ("LoadLoraAdapter", "UnloadLoraAdapter", "ListLoraAdapters"):  # the adapter table
        assert RULES[engine + method] == {"gateway", "admin"}
    assert RULES["/gridserve.worker.v1.Worker/CollectiveRPC"] == {"engine"}
    coordinator = "/gridserve.coordinator.v1.Coordinator/"
    assert RULES[coordinator + "WatchLoad"] == {"engine", "gateway"}  # a gateway only watches
    assert all(RULES[coordinator + m] == {"engine"} for m in ("ReportLoad", "StartWave", "SyncStep"))
    assert all(RULES[m] == {"edge", "admin"} for m in RULES if m.startswith("/gridserve.gateway"))


def test_tls_flags_go_together_and_name_the_missing_one(tmp_path):
    ca = LocalCA(tmp_path)
    files = ca.issue("engine")
    args = argparse.Namespace(tls_cert_file=str(files.cert), tls_key_file=str(files.key), tls_ca_file=None)
    with pytest.raises(ConfigError, match="tls-ca-file"):
        TlsFiles.from_args(args)
    args.tls_ca_file = str(tmp_path / "missing.crt")
    with pytest.raises(ConfigError, match="cannot read"):
        TlsFiles.from_args(args)
    args.tls_ca_file = str(files.ca)
    assert TlsFiles.from_args(args) == files
    assert TlsFiles.from_args(argparse.Namespace(tls_cert_file=None, tls_key_file=None, tls_ca_file=None)) is None
    assert (tmp_path.stat().st_mode & 0o777) == 0o700 and (files.key.stat().st_mode & 0o777) == 0o600


def _coordinator(port: int, tls: TlsFiles, health_port=None) -> RpcServer:
    server = RpcServer("127.0.0.1", port, role="coordinator", tls=tls, health_port=health_port)
    table = LoadTable()
    servicer = CoordinatorServicer(table, Waves(1, on_change=table.bump))
    server.add_service("gridserve.coordinator.v1.Coordinator",
                       lambda s: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, s))
    server.start()
    server.readiness.set(State.READY)
    return server


def test_refusals_are_permission_denied_counted_and_health_stays_open(tmp_path):
    ca = LocalCA(tmp_path)
    files = ca.issue_all()
    server = _coordinator(0, files["coordinator"], health_port=0)
    try:
        for role, allowed in (("engine", True), ("gateway", False), ("worker", False), ("admin", False)):
            with make_channel(server.address, files[role]) as channel:
                assert health_status(channel) == "SERVING"
                stub = coordinator_pb2_grpc.CoordinatorStub(channel)
                try:
                    stub.SyncStep(coordinator_pb2.SyncStepRequest(), timeout=5)
                    outcome = None
                except grpc.RpcError as exc:
                    outcome = exc
                if allowed:
                    assert outcome is None or outcome.code() != grpc.StatusCode.PERMISSION_DENIED
                else:
                    assert outcome.code() == grpc.StatusCode.PERMISSION_DENIED
                    assert role in outcome.details() and "SyncStep" in outcome.details()
        assert server.authorization.denied == {("/gridserve.coordinator.v1.Coordinator/SyncStep", "gateway"): 1,
                                               ("/gridserve.coordinator.v1.Coordinator/SyncStep", "worker"): 1,
                                               ("/gridserve.coordinator.v1.Coordinator/SyncStep", "admin"): 1}
        # The plaintext health port: readiness and liveness, nothing else.
        with grpc.insecure_channel(f"127.0.0.1:{server.health_port}") as channel:
            assert health_status(channel) == "SERVING" and health_status(channel, "liveness") == "SERVING"
            reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
            with pytest.raises(grpc.RpcError) as error:
                list(reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                     timeout=5))
            assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED
            with pytest.raises(grpc.RpcError) as error:
                coordinator_pb2_grpc.CoordinatorStub(channel).SyncStep(coordinator_pb2.SyncStepRequest(), timeout=5)
            assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED
        server.readiness.set(State.DRAINING, "test")
        with grpc.insecure_channel(f"127.0.0.1:{server.health_port}") as channel:
            assert health_status(channel) == "NOT_SERVING" and health_status(channel, "liveness") == "SERVING"
    finally:
        server.shutdown()


def test_plaintext_on_a_non_loopback_address_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="gridserve.shared.rpc.server"):
        server = RpcServer("0.0.0.0", 0, role="worker", tls=None, insecure_internal=True)  # else refused
        server.start()
        server.shutdown()
    assert any("plaintext" in r.message for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gridserve.shared.rpc.server"):
        server = RpcServer("127.0.0.1", 0, role="worker", tls=None)
        server.start()
        server.shutdown()
    assert not any("plaintext" in r.message for r in caplog.records)


def test_a_role_channel_uses_the_new_client_certificate_after_rotation(tmp_path):
    """The server at the same address comes back trusting only a new CA: the old certificate is
    refused there; the role's channel, once its files were replaced, reconnects with the new one."""
    first, second = LocalCA(tmp_path / "first"), LocalCA(tmp_path / "second")
    client_files = first.issue("engine")
    client_files.ca.write_bytes(first.ca_pem + second.ca_pem)
    old = TlsFiles(tmp_path / "old.crt", tmp_path / "old.key", client_files.ca)
    old.cert.write_bytes(client_files.cert.read_bytes())
    old.key.write_bytes(client_files.key.read_bytes())
    port = free_port()
    runner = LoopThread("test-client")
    server = _coordinator(port, first.issue("coordinator"))
    configure(client_files)
    try:
        channel = runner.call(lambda: aio_channel(f"127.0.0.1:{port}"))
        stub = health_pb2_grpc.HealthStub(channel)

        async def ask() -> int:
            return (await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)).status

        def check() -> int:
            return runner.run(ask(), timeout=10)

        assert check() == health_pb2.HealthCheckResponse.SERVING
        server.shutdown()  # the connection ends; the next server trusts only the second CA
        server = _coordinator(port, second.issue("coordinator"))
        with make_channel(f"127.0.0.1:{port}", old) as plain:
            assert health_status(plain) == "UNREACHABLE"  # the old certificate is refused now
        with pytest.raises(grpc.RpcError):
            check()  # the role's channel still holds the old certificate
        new = second.issue("engine", name="engine-new")
        client_files.key.write_bytes(new.key.read_bytes())
        client_files.cert.write_bytes(new.cert.read_bytes())
        assert check() == health_pb2.HealthCheckResponse.SERVING  # a new connection, the new certificate
        runner.run(channel.close(), timeout=10)
    finally:
        configure(None)
        server.shutdown()
        runner.stop()


def _config(vocab=100, max_len=32):
    return SimpleNamespace(model=SimpleNamespace(vocab_size=vocab, max_model_len=max_len, max_logprobs=5))


@pytest.mark.parametrize("prompt, params, field", [
    ([], SamplingParams(max_tokens=4), "prompt_token_ids"),
    ([1, 100], SamplingParams(max_tokens=4), "prompt_token_ids"),
    ([1, -1], SamplingParams(max_tokens=4), "prompt_token_ids"),
    (list(range(32)), SamplingParams(max_tokens=1), "prompt_token_ids"),
    ([1, 2], SamplingParams(max_tokens=31), "sampling_params.max_tokens"),
    ([1, 2], SamplingParams(max_tokens=4, logprobs=6), "sampling_params.logprobs"),
    ([1, 2], SamplingParams(max_tokens=4, stop_token_ids=[100]), "sampling_params.stop_token_ids"),
    ([1, 2], SamplingParams(max_tokens=4, allowed_token_ids=[3, 1000]), "sampling_params.allowed_token_ids"),
    ([1, 2], SamplingParams(max_tokens=4, logit_bias={-5: 1.0}), "sampling_params.logit_bias"),
])
def test_the_engine_checks_what_a_gateway_sends(prompt, params, field):
    with pytest.raises(InvalidArgumentError) as error:
        check_request(_config(), prompt, params)
    assert error.value.field == field


def test_the_engine_accepts_a_request_within_bounds():
    check_request(_config(), [0, 99], SamplingParams(max_tokens=30, logprobs=5, stop_token_ids=[99],
                                                     allowed_token_ids=[0, 1], logit_bias={2: 1.0}))
    check_request(_config(), [1], SamplingParams(max_tokens=None))
    assert health_pb2 and health_pb2_grpc  # the health protos the probes use


def test_serve_tls_makes_a_private_certificate_folder_and_removes_it_on_stop():
    from gridserve.launcher import Launcher

    launcher = Launcher("unused-model", [], tls=True)
    launcher._make_certificates()
    folder = launcher.ca.folder
    assert (folder.stat().st_mode & 0o777) == 0o700
    assert set(launcher.certificates) == {"worker", "engine", "gateway", "coordinator", "edge", "admin"}
    assert launcher.edge_ca_file and launcher.admin_tls.cert.exists()
    assert "--tls-cert-file" in launcher.certificates["engine"].argv()
    launcher.stop()
    assert not folder.exists() and launcher.certificates == {}


def test_a_library_process_takes_its_certificate_from_the_environment(tmp_path, monkeypatch):
    from gridserve.shared.rpc import tls

    files = LocalCA(tmp_path).issue("gateway")
    for name, path in (("CERT", files.cert), ("KEY", files.key), ("CA", files.ca)):
        monkeypatch.setenv(f"GRIDSERVE_TLS_{name}_FILE", str(path))
    monkeypatch.setattr(tls, "_active", tls._UNSET)
    assert tls.active() == files
    configure(None)  # an explicit choice wins
    assert tls.active() is None
