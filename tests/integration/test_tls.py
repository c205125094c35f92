"""``gridserve serve --tls``: mutual TLS on every gRPC link, authorization by role, HTTPS at the edge.

One deployment for the module (worker, engine, gateway, Envoy; a throwaway CA and one certificate
per role, as ``serve --tls`` makes them, scoped to a random deployment name). The official openai client and the native gRPC example
talk HTTPS / gRPC over TLS to the edge with that CA; every refusal the issue lists is checked with
real certificates against the real processes; the last test rotates certificates under open streams.
"""

from __future__ import annotations

import json
import re
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent import futures
from pathlib import Path
from typing import Optional

import grpc
import pytest

from gridserve.api.engine.v1 import engine_pb2
from gridserve.api.gateway.v1 import gateway_pb2
from gridserve.api.worker.v1 import worker_pb2, worker_pb2_grpc
from gridserve.certificates import LocalCA, serial_of, write_atomically
from gridserve.edge import (
    GATEWAY_SERVICE,
    envoy_argv,
    envoy_config,
    gateway_san_matchers,
    write_config,
)
from gridserve.launcher import free_port
from gridserve.shared.rpc.client import health_status, make_channel
from gridserve.shared.rpc.tls import TlsFiles

from .services import address, deployment, engine_stub, gateway_stub, greedy, token_prompt
from .test_edge import (  # the openai-client tests of the plaintext edge, here over HTTPS  # noqa: F401
    MAX_TOKENS,
    PROMPT,
    model_name,
    offline,
    test_openai_chat_completion,
    test_openai_completion_equals_offline_llm,
    test_openai_models_list,
    test_openai_n_logprobs_stop_seed_and_length,
    test_openai_streaming_chat_first_chunk_has_role,
)

pytestmark = pytest.mark.slow
REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def edge(llama_tiny, tmp_path_factory):
    with deployment(llama_tiny, tmp_path_factory.mktemp("logs"), edge_port=free_port(), tls=True) as launcher:
        yield launcher


@pytest.fixture(scope="module")
def certs(edge) -> dict[str, TlsFiles]:
    return edge.certificates


@pytest.fixture(scope="module")
def client(edge):
    openai = pytest.importorskip("openai")
    context = ssl.create_default_context(cafile=edge.edge_ca_file)
    return openai.OpenAI(base_url=f"https://{edge.edge_address}/v1", api_key="unused", max_retries=0, timeout=60,
                         http_client=openai.DefaultHttpxClient(verify=context))


def _edge_channel(edge) -> grpc.Channel:
    with open(edge.edge_ca_file, "rb") as f:
        return grpc.secure_channel(edge.edge_address, grpc.ssl_channel_credentials(root_certificates=f.read()))


def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as error:
        call()
    return error.value.code(), error.value.details() or ""


def _add(prompt: list[int], request_id: str = "r-tls") -> engine_pb2.AddRequestRequest:
    return engine_pb2.AddRequestRequest(request_id=request_id, gateway_id="test-gateway", prompt_token_ids=prompt,
                                        sampling_params=greedy(4))


# ---- end to end over TLS -----------------------------------------------------------------------
def test_every_role_runs_mutual_tls_and_the_edge_serves_https(edge):
    assert edge.ca is not None and (edge.ca.folder.stat().st_mode & 0o777) == 0o700
    for proc in edge.processes:
        if proc.role != "edge":
            assert "--tls-cert-file" in proc.argv, proc.role
    context = ssl.create_default_context(cafile=edge.edge_ca_file)
    with urllib.request.urlopen(f"https://{edge.edge_address}/health", context=context, timeout=30) as resp:
        assert resp.status == 200


def test_native_grpc_example_over_tls(edge):
    out = subprocess.run([sys.executable, str(REPO_ROOT / "examples" / "grpc_client.py"), edge.edge_address,
                          "def add(a, b):", "--max-tokens", "6", "--ca-file", edge.edge_ca_file],
                         capture_output=True, text=True, timeout=120, check=True)
    assert re.search(r"LENGTH, 6 tokens\]", out.stdout), out.stdout + out.stderr


def test_an_operators_certificate_at_the_edge(edge, certs, tmp_path):
    """``--ssl-certfile`` / ``--ssl-keyfile``: Envoy serves HTTPS with a certificate from another CA
    (here in front of the module's gateway, mTLS to it with the edge certificate)."""
    import time

    from gridserve.launcher import RoleProcess

    public = LocalCA(tmp_path / "public").issue("edge", name="public")
    port = free_port()
    config = envoy_config("127.0.0.1", port, [address(edge, "gateway")],
                          downstream_tls=(str(public.cert), str(public.key)),
                          upstream_tls=(str(certs["edge"].cert), str(certs["edge"].key), str(certs["edge"].ca)))
    process = subprocess.Popen(envoy_argv(write_config(tmp_path / "envoy.json", config)))
    try:
        proc = RoleProcess("edge", f"127.0.0.1:{port}", process)
        edge._wait_https(proc, time.monotonic() + 60)  # what the launcher does for an operator's certificate
        context = ssl.create_default_context(cafile=str(public.ca))
        with urllib.request.urlopen(f"https://127.0.0.1:{port}/health", context=context, timeout=30) as resp:
            assert resp.status == 200
        with pytest.raises(urllib.error.URLError):  # the throwaway CA does not vouch for it
            urllib.request.urlopen(f"https://127.0.0.1:{port}/health",
                                   context=ssl.create_default_context(cafile=edge.edge_ca_file), timeout=30)
    finally:
        process.terminate()
        process.wait(timeout=30)


# ---- refusals ------------------------------------------------------------------------------------
def test_a_client_without_a_certificate_fails_the_handshake(edge, certs):
    with open(certs["admin"].ca, "rb") as f:
        server_only = grpc.ssl_channel_credentials(root_certificates=f.read())
    for role in ("gateway", "engine", "worker"):
        with grpc.secure_channel(address(edge, role), server_only) as channel:
            assert health_status(channel) == "UNREACHABLE", role
        with grpc.insecure_channel(address(edge, role)) as channel:
            assert health_status(channel) == "UNREACHABLE", role
        with make_channel(address(edge, role), certs["admin"]) as channel:
            assert health_status(channel) == "SERVING", role


def test_a_certificate_from_another_ca_is_refused(edge, tmp_path):
    other = LocalCA(tmp_path / "other")
    impostor = other.issue("gateway")
    with make_channel(address(edge, "engine"), impostor) as channel:
        code, _ = _code(lambda: engine_stub(channel).AddRequest(_add(PROMPT), timeout=10))
    assert code == grpc.StatusCode.UNAVAILABLE


def test_a_gateway_certificate_cannot_drive_a_worker(edge, certs):
    with make_channel(address(edge, "worker"), certs["gateway"]) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        request = worker_pb2.CollectiveRPCRequest(call_id=1)
        code, details = _code(lambda: list(stub.CollectiveRPC(iter([request]), timeout=10)))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert "gateway" in details and "/gridserve.worker.v1.Worker/CollectiveRPC" in details


def test_a_worker_certificate_cannot_add_requests(edge, certs):
    with make_channel(address(edge, "engine"), certs["worker"]) as channel:
        code, details = _code(lambda: engine_stub(channel).AddRequest(_add(PROMPT), timeout=10))
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert "worker" in details and "AddRequest" in details


def test_only_admin_may_put_the_engine_to_sleep_or_drive_its_workers(edge, certs):
    with make_channel(address(edge, "engine"), certs["gateway"]) as channel:
        code, details = _code(lambda: engine_stub(channel).Sleep(engine_pb2.SleepRequest(), timeout=10))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "gateway" in details and "Sleep" in details
        code, details = _code(lambda: engine_stub(channel).CollectiveRpc(
            engine_pb2.CollectiveRpcRequest(method="echo"), timeout=10))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "CollectiveRpc" in details
        assert engine_stub(channel).GetInfo(engine_pb2.GetInfoRequest(), timeout=10).vocab_size > 0
    metrics = f"http://{next(p.metrics_address for p in edge.processes if p.role == 'engine')}/metrics"
    text = urllib.request.urlopen(metrics, timeout=10).read().decode()
    assert re.search(r'gridserve:rpc_denied_total\{identity="gateway",method="/gridserve.engine.v1.EngineCore/'
                     r'Sleep"\} [1-9]', text), [line for line in text.splitlines() if "denied" in line]


def test_the_engine_refuses_token_ids_outside_the_vocabulary_and_keeps_serving(edge, certs):
    with make_channel(address(edge, "engine"), certs["gateway"]) as channel:
        stub = engine_stub(channel)
        vocab = stub.GetInfo(engine_pb2.GetInfoRequest(), timeout=10).vocab_size
        code, details = _code(lambda: stub.AddRequest(_add([5, vocab + 7, 3], "r-oov"), timeout=10))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "prompt_token_ids" in details and str(vocab + 7) in details
        code, details = _code(lambda: stub.AddRequest(_add([5, -3], "r-negative"), timeout=10))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert health_status(channel) == "SERVING"
    with _edge_channel(edge) as channel:
        responses = list(gateway_stub(channel).Generate(token_prompt(PROMPT, greedy(MAX_TOKENS)), timeout=60))
    assert sum(len(r.token_ids) for r in responses) == MAX_TOKENS


def test_a_certificate_of_the_same_ca_for_another_deployment_is_refused_by_each_role(edge):
    """The roles take only names of their deployment (``serve --tls`` picks one at random): the same
    CA's certificate for another deployment, or with today's unscoped names, names no role."""
    assert re.fullmatch(r"serve-[0-9a-f]{8}", edge.ca.deployment)
    for proc in edge.processes:
        if proc.role != "edge":
            assert proc.argv[proc.argv.index("--tls-deployment") + 1] == edge.ca.deployment, proc.role
    calls = {  # the role served -> the role allowed to call it, and a call
        "engine": ("gateway", lambda channel: engine_stub(channel).GetInfo(engine_pb2.GetInfoRequest(), timeout=10)),
        "worker": ("engine", lambda channel: list(worker_pb2_grpc.WorkerStub(channel).CollectiveRPC(
            iter([worker_pb2.CollectiveRPCRequest(call_id=1)]), timeout=10))),
        "gateway": ("edge", lambda channel: gateway_stub(channel).ListModels(gateway_pb2.ListModelsRequest(),
                                                                          timeout=10)),
    }
    for served, (caller, call) in calls.items():
        for scope in ("serve-0ther000", ""):  # another deployment's names; unscoped names
            files = edge.ca.issue(caller, f"other-{caller}-{scope or 'unscoped'}", deployment=scope)
            with make_channel(address(edge, served), files) as channel:
                assert health_status(channel) == "SERVING"  # the handshake passes: the CA is the same
                code, details = _code(lambda: call(channel))  # noqa: B023
            assert code == grpc.StatusCode.PERMISSION_DENIED, (served, scope)
            assert f"not scoped to this deployment, {edge.ca.deployment}" in details, details
    # The edge too: it dials the gateways taking only this deployment's gateway names.
    config = json.loads((edge.log_dir / "edge-0.json").read_text())
    sans = [c["transport_socket"]["typed_config"]["common_tls_context"]["validation_context"]
            ["match_typed_subject_alt_names"] for c in config["static_resources"]["clusters"] if "transport_socket" in c]
    assert sans == [gateway_san_matchers(edge.ca.deployment)] * 2


# ---- the edge dials only this deployment's gateways (no model: a stand-in gateway) ----------------
def _stand_in_gateway(files: TlsFiles) -> tuple[grpc.Server, str]:
    """A gRPC server presenting ``files`` (mutual TLS, their CA) that is SERVING and answers
    ``GetStatus`` with an empty status: all the edge needs to proxy ``GET /v1/status``."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(GATEWAY_SERVICE, {
        "GetStatus": grpc.unary_unary_rpc_method_handler(
            lambda request, context: gateway_pb2.GetStatusResponse(),
            request_deserializer=gateway_pb2.GetStatusRequest.FromString,
            response_serializer=gateway_pb2.GetStatusResponse.SerializeToString)}),))
    credentials = grpc.ssl_server_credentials([(files.key.read_bytes(), files.cert.read_bytes())],
                                              root_certificates=files.ca.read_bytes(), require_client_auth=True)
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    return server, f"127.0.0.1:{port}"


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


DEPLOYMENT = "serve-5c0bed00"


@pytest.mark.parametrize("role, scope, edge_scope, accepted", [
    ("gateway", None, DEPLOYMENT, True),  # this deployment's gateway: gateway[-0].D.gridserve.internal
    ("gateway-3", None, DEPLOYMENT, True),  # an instance's name alone: gateway-3.D.gridserve.internal
    ("gateway", "serve-0ther000", DEPLOYMENT, False),  # the same CA, another deployment's gateway
    ("gateway", "", DEPLOYMENT, False),  # only the unscoped gateway.gridserve.internal
    ("engine", None, DEPLOYMENT, False),  # this deployment, another role
    ("gateway", "serve-0ther000", None, True),  # an edge without a deployment takes any gateway the CA signed
], ids=["scoped", "instance", "other-deployment", "unscoped", "engine", "unscoped-edge"])
def test_the_edge_proxies_only_to_a_gateway_of_its_deployment(tmp_path, role: str, scope: Optional[str],
                                                              edge_scope: Optional[str], accepted: bool):
    """Envoy checks the gateway's certificate when it dials it: one from the deployment's own CA
    but naming another deployment (which also carries the unscoped gateway.gridserve.internal) fails
    the handshake, and the edge answers 503 instead of proxying."""
    ca = LocalCA(tmp_path / "ca", deployment=DEPLOYMENT)
    edge_files = ca.issue("edge")
    gateway_files = ca.issue(role, "gateway", instance="0" if role == "gateway" else None, deployment=scope)
    server, gateway = _stand_in_gateway(gateway_files)
    port, admin = free_port(), free_port()
    config = envoy_config("127.0.0.1", port, [gateway], admin_port=admin, tls_deployment=edge_scope,
                          upstream_tls=(str(edge_files.cert), str(edge_files.key), str(edge_files.ca)))
    process = subprocess.Popen(envoy_argv(write_config(tmp_path / "envoy.json", config)))
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                status, body = _get(f"http://127.0.0.1:{port}/v1/status")
                break
            except (urllib.error.URLError, ConnectionError):  # Envoy is still starting
                assert process.poll() is None and time.monotonic() < deadline, "the edge did not start"
                time.sleep(0.2)
        with urllib.request.urlopen(f"http://127.0.0.1:{admin}/stats?filter=ssl.fail_verify_san", timeout=10) as resp:
            stats = dict(line.split(": ") for line in resp.read().decode().splitlines() if ": " in line)
        refusals = int(stats.get("cluster.gateways_any_state.ssl.fail_verify_san", "0"))
        if accepted:
            assert status == 200, body
            assert refusals == 0
        else:
            assert status == 503, body
            assert "upstream connect error" in json.loads(body)["error"]["message"], body
            assert refusals > 0, stats  # the gateway's names, not the handshake as such
    finally:
        process.terminate()
        process.wait(timeout=30)
        server.stop(0)


# ---- rotation (last: it changes the deployment's certificates) -----------------------------------
def _server_certificate_serial(addr: str, client: TlsFiles) -> int:
    """The serial of the certificate a server presents on a new connection."""
    context = ssl.create_default_context(cafile=str(client.ca))
    context.load_cert_chain(str(client.cert), str(client.key))
    context.set_alpn_protocols(["h2"])
    host, _, port = addr.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock, \
            context.wrap_socket(sock, server_hostname=host) as tls:
        return serial_of(ssl.DER_cert_to_PEM_cert(tls.getpeercert(binary_form=True)).encode())


def test_rotating_certificates_keeps_open_streams_and_new_connections_use_the_new_ones(edge, certs, tmp_path):
    ca, gateway, engine, worker = edge.ca, certs["gateway"], certs["engine"], certs["worker"]
    old_gateway_serial = serial_of(gateway.cert.read_bytes())
    assert _server_certificate_serial(address(edge, "gateway"), certs["admin"]) == old_gateway_serial
    old_engine = TlsFiles(tmp_path / "e.crt", tmp_path / "e.key", engine.ca)
    old_engine.cert.write_bytes(engine.cert.read_bytes())
    old_engine.key.write_bytes(engine.key.read_bytes())
    with make_channel(address(edge, "engine"), certs["admin"]) as channel:  # engine -> worker before
        status = engine_stub(channel).GetStatus(engine_pb2.GetStatusRequest(), timeout=30)
        assert [w.health for w in status.workers] == ["SERVING"]
    second = LocalCA(tmp_path / "second", deployment=ca.deployment)  # a new CA of the same deployment
    with _edge_channel(edge) as channel:
        stream = gateway_stub(channel).Generate(token_prompt(PROMPT, greedy(200)), timeout=120)
        first = next(stream)  # the streams (edge -> gateway -> engine -> worker) are open
        # The gateway's server certificate: a new one from the same CA.
        # (the same identity, gateway-0: an engine keys the gateway's streams by it)
        new_gateway_serial = serial_of(ca.issue("gateway", instance="0").cert.read_bytes())
        # The engine's certificate from a second CA; the engine (and everyone but the worker)
        # trusts both CAs; the worker only the second one: only the new engine certificate gets in.
        for role in ("engine", "gateway", "admin", "edge"):
            write_atomically(certs[role].ca, ca.ca_pem + second.ca_pem)
        new_engine = second.issue("engine", instance="0")
        write_atomically(engine.key, new_engine.key.read_bytes())
        write_atomically(engine.cert, new_engine.cert.read_bytes())
        write_atomically(worker.ca, second.ca_pem)
        rest = list(stream)
    assert sum(len(r.token_ids) for r in [first, *rest]) == 200  # the open streams finished
    assert _server_certificate_serial(address(edge, "gateway"), certs["admin"]) == new_gateway_serial
    # The worker refuses the engine's old certificate now, and takes the engine's new connection.
    with make_channel(address(edge, "worker"), old_engine) as channel:
        assert health_status(channel) == "UNREACHABLE"
    with make_channel(address(edge, "engine"), certs["admin"]) as channel:
        status = engine_stub(channel).GetStatus(engine_pb2.GetStatusRequest(), timeout=30)
        assert [w.health for w in status.workers] == ["SERVING"]
    with _edge_channel(edge) as channel:  # and the deployment serves on
        responses = list(gateway_stub(channel).Generate(token_prompt(PROMPT, greedy(4)), timeout=60))
    assert sum(len(r.token_ids) for r in responses) == 4
    assert gateway_pb2.GenerateResponse  # the public API is unchanged
