"""Least privilege between roles: a gateway only watches the coordinator; with a certificate per
instance (``engine-<rank>``, ``gateway-<n>``) an engine writes only its own coordinator entry and
wave barriers, and a gateway's output stream and aborts are its own. With one certificate per role
(what ``LocalCA.issue_all`` and the chart issue today) everything that works keeps working."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import grpc
import pytest
from cryptography import x509

from gridserve.api.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc
from gridserve.api.engine.v1 import engine_pb2
from gridserve.certificates import LocalCA
from gridserve.launcher import Launcher
from gridserve.services.coordinator.load_table import LoadTable
from gridserve.services.coordinator.servicer import CoordinatorServicer
from gridserve.services.coordinator.waves import Waves
from gridserve.services.engine.core import EngineCore
from gridserve.services.engine.loop import EngineLoop
from gridserve.services.engine.servicer import EngineServicer
from gridserve.shared.config import GridserveConfig, ModelConfig
from gridserve.shared.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    PermissionDeniedError,
)
from gridserve.shared.readiness import Readiness, State
from gridserve.shared.rpc.authz import RULES, identity_of, instance_of
from gridserve.shared.rpc.client import make_channel
from gridserve.shared.rpc.convert import sampling_params_to_pb
from gridserve.shared.rpc.server import RpcServer
from gridserve.shared.sampling_params import SamplingParams
from tests.unit.engine.test_engine_recovery import FakeGroup

REPO = Path(__file__).resolve().parents[3]
COORDINATOR = "/gridserve.coordinator.v1.Coordinator/"


def _auth(cn: str = "", sans: tuple[str, ...] = (), tls: bool = True) -> dict:
    auth = {"transport_security_type": [b"ssl" if tls else b"insecure"]}
    if cn:
        auth["x509_common_name"] = [cn.encode()]
    if sans:
        auth["x509_subject_alternative_name"] = [s.encode() for s in sans]
    return auth


def _role_cert(role: str) -> dict:
    """What ``LocalCA.issue`` writes: one certificate per role."""
    return _auth(role, (f"{role}.gridserve.internal", "localhost", "127.0.0.1"))


def _instance_cert(role: str, instance: str) -> dict:
    """A certificate per instance: the role's names plus ``<role>-<id>.gridserve.internal``."""
    return _auth(role, (f"{role}.gridserve.internal", f"{instance}.gridserve.internal", "localhost"))


class _Aborted(Exception):
    pass


class _Context:
    """The part of ``grpc.aio.ServicerContext`` the servicers use."""

    def __init__(self, auth: dict) -> None:
        self.auth = auth

    def auth_context(self) -> dict:
        return self.auth

    def peer(self) -> str:
        return "ipv4:10.0.0.9:5000"

    def invocation_metadata(self) -> tuple:
        return ()

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise _Aborted(code, details)


# ---- the table -----------------------------------------------------------------------------------
def test_gateways_may_only_watch_the_coordinator():
    for method in ("ReportLoad", "StartWave", "SyncStep"):
        assert RULES[COORDINATOR + method] == {"engine"}, method
    assert RULES[COORDINATOR + "WatchLoad"] == {"engine", "gateway"}


def test_the_gateway_code_calls_no_coordinator_method_but_watch_load():
    """What the table allows the gateway is what its code calls (LoadWatcher -> LoadSubscription)."""
    sources = [*(REPO / "services" / "gateway").glob("*.py"), REPO / "shared" / "rpc" / "coordinator_client.py"]
    called = set()
    for path in sources:
        called |= set(re.findall(r"\.(ReportLoad|WatchLoad|StartWave|SyncStep)\(", path.read_text(encoding="utf-8")))
    assert called == {"WatchLoad"}


def test_a_gateway_certificate_is_refused_at_report_load_start_wave_and_sync_step(tmp_path):
    files = LocalCA(tmp_path).issue_all()
    server = RpcServer("127.0.0.1", 0, role="coordinator", tls=files["coordinator"])
    table = LoadTable()
    servicer = CoordinatorServicer(table, Waves(1, on_change=table.bump))
    server.add_service("gridserve.coordinator.v1.Coordinator",
                       lambda s: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, s))
    server.start()
    server.readiness.set(State.READY)
    try:
        with make_channel(server.address, files["gateway"]) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            report = coordinator_pb2.ReportLoadRequest(load=coordinator_pb2.EngineLoad(dp_rank=0, address="x:1"))
            for call in (lambda: stub.ReportLoad(iter([report]), timeout=5),
                         lambda: stub.StartWave(coordinator_pb2.StartWaveRequest(dp_rank=0), timeout=5),
                         lambda: stub.SyncStep(coordinator_pb2.SyncStepRequest(), timeout=5)):
                with pytest.raises(grpc.RpcError) as refused:
                    call()
                assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert table.snapshot()[1] == []  # nothing written
            watch = stub.WatchLoad(coordinator_pb2.WatchLoadRequest(subscriber_id="g"), timeout=5)
            assert next(iter(watch)).engines == []  # the one call a gateway makes
            watch.cancel()
    finally:
        server.shutdown()


def test_over_real_mutual_tls_an_engine_instance_reports_only_its_own_rank(tmp_path):
    ca = LocalCA(tmp_path)
    server = RpcServer("127.0.0.1", 0, role="coordinator", tls=ca.issue("coordinator"))
    table = LoadTable()
    servicer = CoordinatorServicer(table, Waves(1, on_change=table.bump))
    server.add_service("gridserve.coordinator.v1.Coordinator",
                       lambda s: coordinator_pb2_grpc.add_CoordinatorServicer_to_server(servicer, s))
    server.start()
    server.readiness.set(State.READY)
    try:
        with make_channel(server.address, ca.issue("engine", "engine-1", instance="1")) as channel:
            stub = coordinator_pb2_grpc.CoordinatorStub(channel)
            with pytest.raises(grpc.RpcError) as refused:
                stub.StartWave(coordinator_pb2.StartWaveRequest(dp_rank=0), timeout=5)
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "engine-1 may not speak for dp_rank 0" in refused.value.details()
            assert stub.StartWave(coordinator_pb2.StartWaveRequest(dp_rank=1), timeout=5).wave == 0
    finally:
        server.shutdown()


def test_serve_tls_issues_one_certificate_per_engine_and_gateway():
    launcher = Launcher("unused-model", [], tls=True, data_parallel_size=2, api_server_count=2)
    launcher._make_certificates()
    names = {}
    for role, index in (("engine", 0), ("engine", 1), ("gateway", 0), ("gateway", 1), ("worker", 1)):
        cert = x509.load_pem_x509_certificate(launcher.certificate_for(role, index).cert.read_bytes())
        names[(role, index)] = sorted(cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
                                      .value.get_values_for_type(x509.DNSName))
    # Scoped to the launcher's own deployment (the unscoped role name stays, for the edge's Envoy).
    d = launcher.ca.deployment
    assert re.fullmatch(r"serve-[0-9a-f]{8}", d)
    assert names[("engine", 0)] == [f"engine-0.{d}.gridserve.internal", "engine.gridserve.internal",
                                    f"engine.{d}.gridserve.internal", "localhost"]
    assert names[("engine", 1)] == [f"engine-1.{d}.gridserve.internal", "engine.gridserve.internal",
                                    f"engine.{d}.gridserve.internal", "localhost"]
    assert names[("gateway", 1)] == [f"gateway-1.{d}.gridserve.internal", "gateway.gridserve.internal",
                                     f"gateway.{d}.gridserve.internal", "localhost"]
    assert names[("worker", 1)] == ["localhost", "worker.gridserve.internal",
                                    f"worker.{d}.gridserve.internal"]  # workers: one per role
    assert launcher.certificate_for("engine", 0) == launcher.certificates["engine"]
    launcher.ca.cleanup()


# ---- the instance a certificate names ------------------------------------------------------------
@pytest.mark.parametrize("auth, instance", [
    (_role_cert("engine"), None),
    (_instance_cert("engine", "engine-3"), "engine-3"),
    (_instance_cert("gateway", "gateway-0"), "gateway-0"),
    (_auth("engine", ("engine.gridserve.internal", "spiffe://cluster.local/ns/llm/sa/gridserve-engine-2")),
     "engine-2"),
    (_auth("engine-5", ("engine.gridserve.internal",)), "engine-5"),
    (_auth("engine", ("engine.gridserve.internal", "gateway-1.gridserve.internal")), None),  # not its role
    (_instance_cert("engine", "engine-3") | {"transport_security_type": [b"insecure"]}, None),
])
def test_the_instance_is_a_name_of_the_certificate_s_one_role(auth, instance):
    assert instance_of(auth) == instance


def test_a_certificate_naming_two_instances_is_refused():
    auth = _auth("engine", ("engine.gridserve.internal", "engine-1.gridserve.internal", "engine-2.gridserve.internal"))
    assert identity_of(auth) == "engine"
    with pytest.raises(PermissionDeniedError, match="engine-1, engine-2"):
        instance_of(auth)


# ---- the coordinator: an engine's entry is written by that engine ----------------------------------
async def _reports(*ranks: int):
    for rank in ranks:
        yield coordinator_pb2.ReportLoadRequest(load=coordinator_pb2.EngineLoad(dp_rank=rank, address=f"e{rank}:1"))


def _coordinator() -> tuple[CoordinatorServicer, LoadTable]:
    table = LoadTable()
    return CoordinatorServicer(table, Waves(2, on_change=table.bump, timeout_s=0.2)), table


def test_an_engine_with_an_instance_certificate_reports_only_its_own_rank():
    async def go():
        servicer, table = _coordinator()
        with pytest.raises(PermissionDeniedError, match="engine-1 may not .*dp_rank 0"):
            await servicer.ReportLoad(_reports(0), _Context(_instance_cert("engine", "engine-1")))
        assert table.snapshot()[1] == []
        seen = []

        async def reports_then_look():
            async for request in _reports(1):
                yield request
            seen.extend(e.dp_rank for e in table.snapshot()[1])

        await servicer.ReportLoad(reports_then_look(), _Context(_instance_cert("engine", "engine-1")))
        assert seen == [1]

    asyncio.run(go())


def test_one_report_stream_keeps_the_rank_it_started_with():
    async def go():
        servicer, table = _coordinator()
        with pytest.raises(InvalidArgumentError, match="load.dp_rank"):
            await servicer.ReportLoad(_reports(0, 1), _Context(_role_cert("engine")))
        assert table.snapshot()[1] == []  # the stream's entry left with it

    asyncio.run(go())


def test_with_a_certificate_per_role_and_in_plaintext_any_engine_reports_any_rank():
    async def go():
        for auth in (_role_cert("engine"), _auth(tls=False)):
            servicer, table = _coordinator()
            await servicer.ReportLoad(_reports(3), _Context(auth))  # accepted (and removed at the end)

    asyncio.run(go())


def test_wave_calls_with_another_engine_s_rank_are_refused():
    async def go():
        servicer, _ = _coordinator()
        ctx = _Context(_instance_cert("engine", "engine-0"))
        with pytest.raises(PermissionDeniedError, match="dp_rank 1"):
            await servicer.StartWave(coordinator_pb2.StartWaveRequest(dp_rank=1), ctx)
        with pytest.raises(PermissionDeniedError, match="dp_rank 1"):
            await servicer.SyncStep(coordinator_pb2.SyncStepRequest(dp_rank=1, wave=0, step=0), ctx)
        assert (await servicer.StartWave(coordinator_pb2.StartWaveRequest(dp_rank=0), ctx)).wave == 0

    asyncio.run(go())


# ---- the engine: a gateway's output stream is its own ------------------------------------------------
class _SteadyGroup(FakeGroup):
    """A fake worker at a steady 2 ms per step: a 240-token request outlives a few RPCs on any CPU."""

    def _step(self, sched):
        time.sleep(0.002)
        return super()._step(sched)


def _engine() -> tuple[EngineServicer, EngineLoop]:
    config = GridserveConfig(model=ModelConfig(max_model_len=256, num_layers=1, num_kv_heads=1, head_dim=8,
                                               vocab_size=2000))
    readiness = Readiness("engine")
    readiness.set(State.READY)
    loop = EngineLoop(EngineCore(config, _SteadyGroup(config)), readiness)
    servicer = EngineServicer(config)
    servicer.loop = loop
    return servicer, loop


def _add(request_id: str, gateway_id: str, max_tokens: int = 3) -> engine_pb2.AddRequestRequest:
    params = sampling_params_to_pb(SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return engine_pb2.AddRequestRequest(request_id=request_id, gateway_id=gateway_id, prompt_token_ids=[5, 6, 7],
                                        sampling_params=params)


async def _finished(stream) -> list[str]:
    """The ids of the requests that finish on ``stream`` (until it is quiet for a while)."""
    done = []
    try:
        while True:
            batch = await asyncio.wait_for(anext(stream), 1.0)
            done += [o.request_id for o in batch.outputs if o.finish_reason]
    except asyncio.TimeoutError:
        return done


def test_a_gateway_cannot_take_over_another_gateway_s_output_stream():
    """gateway-1 subscribes with gateway-0's id: with per-instance certificates it gets its own
    stream, gateway-0 keeps its outputs, and gateway-1 cannot route requests into gateway-0's."""

    async def go():
        servicer, loop = _engine()
        first, second = _Context(_instance_cert("gateway", "gateway-0")), _Context(_instance_cert("gateway", "gateway-1"))
        try:
            owned = servicer.StreamOutputs(engine_pb2.StreamOutputsRequest(gateway_id="gw"), first)
            await anext(owned)  # open
            intruder = servicer.StreamOutputs(engine_pb2.StreamOutputsRequest(gateway_id="gw"), second)
            await anext(intruder)
            await servicer.AddRequest(_add("r0", "gw"), first)
            assert await _finished(owned) == ["r0"]
            assert await _finished(intruder) == []
            await owned.aclose()
            await intruder.aclose()
            await asyncio.sleep(0.1)
            with pytest.raises(FailedPreconditionError, match="no open StreamOutputs"):
                await servicer.AddRequest(_add("r1", "gw"), second)  # its own stream is gone
        finally:
            loop.stop()

    asyncio.run(go())


def test_a_gateway_cannot_abort_another_gateway_s_requests():
    async def go():
        servicer, loop = _engine()
        first, second = _Context(_instance_cert("gateway", "gateway-0")), _Context(_instance_cert("gateway", "gateway-1"))
        try:
            stream = servicer.StreamOutputs(engine_pb2.StreamOutputsRequest(gateway_id="gw"), first)
            await anext(stream)
            await servicer.AddRequest(_add("r0", "gw", max_tokens=240), first)
            abort = engine_pb2.AbortRequestsRequest(request_ids=["r0"])
            assert list((await servicer.AbortRequests(abort, second)).aborted_request_ids) == []
            assert list((await servicer.AbortRequests(abort, first)).aborted_request_ids) == ["r0"]
            await stream.aclose()
        finally:
            loop.stop()

    asyncio.run(go())


def test_with_a_certificate_per_role_or_in_plaintext_the_gateway_id_alone_routes():
    async def go():
        for auth in (_role_cert("gateway"), _auth(tls=False)):
            servicer, loop = _engine()
            try:
                ctx = _Context(auth)
                stream = servicer.StreamOutputs(engine_pb2.StreamOutputsRequest(gateway_id="gw"), ctx)
                await anext(stream)
                await servicer.AddRequest(_add("r0", "gw"), ctx)
                assert await _finished(stream) == ["r0"]
                await stream.aclose()
            finally:
                loop.stop()

    asyncio.run(go())
