"""Plaintext never leaves loopback silently (issue 38): a plaintext role refuses to listen beyond
loopback unless told ``--insecure-internal``; with it, the operator's methods still answer only
loopback peers; ``gridserve serve --host`` moves only the edge, the internal roles and the
torch.distributed rendezvous stay on 127.0.0.1."""

from __future__ import annotations

import logging
import socket
from types import SimpleNamespace

import grpc
import pytest

from gridserve.api.engine.v1 import engine_pb2, engine_pb2_grpc
from gridserve.shared.errors import ConfigError
from gridserve.shared.rpc.authz import OPERATOR_ONLY, RULES, peer_is_loopback
from gridserve.shared.rpc.server import RpcServer, is_loopback_host

ENGINE = "/gridserve.engine.v1.EngineCore/"


def _local_non_loopback_address() -> str:
    """An address of this machine that is not loopback (the route to a documentation address)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("192.0.2.1", 9))
            address = sock.getsockname()[0]
        except OSError:
            address = ""
    if not address or is_loopback_host(address) or address == "0.0.0.0":
        pytest.skip("this machine has no non-loopback IPv4 address")
    return address


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.5", "engine.example", "localhost.evil.example"])
def test_a_plaintext_role_refuses_to_listen_beyond_loopback_naming_the_flag(host):
    with pytest.raises(ConfigError, match="--insecure-internal") as error:
        RpcServer(host, 0, role="engine", tls=None, insecure_internal=False)
    assert error.value.field == "insecure-internal" and "mutual TLS" in str(error.value)


def test_with_insecure_internal_it_listens_and_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="gridserve.shared.rpc.server"):
        server = RpcServer("0.0.0.0", 0, role="worker", tls=None, insecure_internal=True)
        server.start()
        server.shutdown()
    assert any("plaintext" in r.getMessage() and "--insecure-internal" in r.getMessage() for r in caplog.records)


def test_the_role_command_line_refuses_a_plaintext_non_loopback_host(capsys, monkeypatch):
    from gridserve.cli import main
    from gridserve.shared.rpc import server

    monkeypatch.delenv("GRIDSERVE_INSECURE_INTERNAL", raising=False)
    try:
        assert main(["coordinator", "--host", "0.0.0.0", "--port", "0"]) == 2
    finally:
        server.allow_insecure_internal(None)
    assert "--insecure-internal" in capsys.readouterr().err


def test_the_operator_only_methods_are_the_admin_rows_of_the_table():
    assert OPERATOR_ONLY == {ENGINE + m for m in ("Sleep", "WakeUp", "ResetPrefixCache", "CollectiveRpc")}
    assert all(RULES[m] == {"admin"} for m in OPERATOR_ONLY)


@pytest.mark.parametrize("peer, local", [
    ("ipv4:127.0.0.1:5000", True), ("ipv4:127.8.9.1:1", True), ("ipv6:[::1]:5000", True),
    ("ipv6:[::ffff:127.0.0.1]:5000", True), ("unix:/tmp/sock", True), ("ipv4:10.0.0.7:5000", False),
    ("ipv6:[2001:db8::1]:443", False), ("ipv6:[::ffff:10.0.0.7]:1", False), ("ipv4:bogus:1", False),
])
def test_loopback_peers(peer, local):
    assert peer_is_loopback(peer) is local


class _Engine(engine_pb2_grpc.EngineCoreServicer):
    async def Sleep(self, request, context):  # noqa: N802 - gRPC's name
        return engine_pb2.SleepResponse(sleeping_tags=["weights"])

    async def GetLoad(self, request, context):  # noqa: N802 - gRPC's name
        return engine_pb2.GetLoadResponse(num_waiting=3)


def test_a_plaintext_role_answers_operator_methods_only_to_loopback_peers():
    outside = _local_non_loopback_address()
    server = RpcServer("0.0.0.0", 0, role="engine", tls=None, insecure_internal=True)
    server.add_service("gridserve.engine.v1.EngineCore",
                       lambda s: engine_pb2_grpc.add_EngineCoreServicer_to_server(_Engine(), s))
    server.start()
    try:
        with grpc.insecure_channel(f"{outside}:{server.port}") as channel:
            stub = engine_pb2_grpc.EngineCoreStub(channel)
            with pytest.raises(grpc.RpcError) as error:
                stub.Sleep(engine_pb2.SleepRequest(level=1), timeout=5)
            assert error.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "Sleep" in error.value.details() and "loopback" in error.value.details()
            assert stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=5).num_waiting == 3  # the request API
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = engine_pb2_grpc.EngineCoreStub(channel)
            assert list(stub.Sleep(engine_pb2.SleepRequest(level=1), timeout=5).sleeping_tags) == ["weights"]
    finally:
        server.shutdown()


class _FakeProcess(SimpleNamespace):
    pid = 4242

    def poll(self):
        return None


def _argv_of(launcher, role: str) -> list[str]:
    proc = launcher._spawn(role, 0, [])
    return list(proc.argv)


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_serve_host_moves_only_the_edge(monkeypatch):
    from gridserve import launcher as launcher_module

    monkeypatch.setattr(launcher_module, "_popen", lambda argv, log, env: _FakeProcess())
    launcher = launcher_module.Launcher("m", [], host="0.0.0.0", tensor_parallel_size=2)
    for role in ("worker", "engine", "gateway", "coordinator"):
        argv = _argv_of(launcher, role)
        assert _flag(argv, "--host") == "127.0.0.1" and "--insecure-internal" not in argv
    assert all(p.address.startswith("127.0.0.1:") and p.metrics_address.startswith("127.0.0.1:")
               for p in launcher.processes)
    rendezvous = _flag(launcher._parallel_args(), "--distributed-init-address")
    assert rendezvous.startswith("127.0.0.1:")

    insecure = launcher_module.Launcher("m", [], host="0.0.0.0", insecure_internal=True, tensor_parallel_size=2)
    argv = _argv_of(insecure, "engine")
    assert _flag(argv, "--host") == "0.0.0.0" and "--insecure-internal" in argv
    # torch.distributed's store has no authentication: loopback even then.
    assert _flag(insecure._parallel_args(), "--distributed-init-address").startswith("127.0.0.1:")
    launcher.processes, insecure.processes = [], []
