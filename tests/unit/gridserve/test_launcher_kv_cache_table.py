"""``gridserve serve``'s process table ends with one KV cache line per engine, from the engine's
``GetInfo`` asked once the deployment is up; an engine that does not answer only loses its line."""

from __future__ import annotations

from concurrent import futures
from types import SimpleNamespace

import grpc

from gridserve import launcher as launcher_module
from gridserve.api.engine.v1 import engine_pb2, engine_pb2_grpc
from gridserve.launcher import Launcher, RoleProcess, free_port, kv_cache_line

INFO = engine_pb2.GetInfoResponse(
    block_size=16, num_kv_blocks=4095,
    kv_cache_groups=[engine_pb2.KVCacheGroupInfo(name="full", kind="full", num_layers=13),
                     engine_pb2.KVCacheGroupInfo(name="sliding_window_16", kind="sliding_window",
                                                 sliding_window=16, num_layers=13)])


class _Engine(engine_pb2_grpc.EngineCoreServicer):
    def GetInfo(self, request, context):
        return INFO


def _engine(address: str, pid: int) -> RoleProcess:
    return RoleProcess("engine", address, SimpleNamespace(pid=pid, poll=lambda: None))


def test_the_line_names_each_group_and_the_pool():
    assert kv_cache_line(0, INFO) == ("kv cache (engine 0): 2 groups: full x13 layers, sliding_window_16 x13 "
                                      "layers; 4,095 blocks of 16 tokens")
    one = engine_pb2.GetInfoResponse(block_size=16, num_kv_blocks=7,
                                     kv_cache_groups=[engine_pb2.KVCacheGroupInfo(name="mla", num_layers=2)])
    assert kv_cache_line(1, one) == "kv cache (engine 1): 1 group: mla x2 layers; 7 blocks of 16 tokens"
    assert kv_cache_line(0, engine_pb2.GetInfoResponse(block_size=16, num_kv_blocks=7)) == (
        "kv cache (engine 0): 7 blocks of 16 tokens")


def test_the_table_gets_a_line_per_engine_that_answers(monkeypatch):
    monkeypatch.setattr(launcher_module, "KV_CACHE_INFO_TIMEOUT_S", 0.5)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    engine_pb2_grpc.add_EngineCoreServicer_to_server(_Engine(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        launcher = Launcher("unused-model", [], data_parallel_size=2)
        launcher.processes = [_engine(f"127.0.0.1:{port}", 101), _engine(f"127.0.0.1:{free_port()}", 102)]
        launcher._fetch_kv_cache_lines()  # the second engine is not there: no line, no exception
    finally:
        server.stop(None)
    table = launcher.table()
    assert table.splitlines()[-1] == kv_cache_line(0, INFO)
    assert "engine 1" not in table and table.count("kv cache") == 1
