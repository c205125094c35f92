"""``GET /v1/status`` per engine: each KV cache group's blocks and share of the pool, from ``GetLoad``."""

from __future__ import annotations

import asyncio

from google.protobuf.json_format import MessageToDict
from grpc_health.v1 import health_pb2

from gridserve.api.engine.v1 import engine_pb2
from gridserve.services.gateway.status import StatusCollector, snapshot_to_pb

LOAD = engine_pb2.GetLoadResponse(
    num_waiting=1, num_running=2, kv_cache_usage=0.4, kv_total_blocks=100,
    kv_cache_groups=[engine_pb2.KVCacheGroupLoad(name="full", num_blocks=30, usage=0.3),
                     engine_pb2.KVCacheGroupLoad(name="sliding_window_16", num_blocks=10, usage=0.1)])


class _Collector(StatusCollector):
    """One engine that answers: SERVING, ``LOAD``, a running loop with one worker."""

    def __init__(self) -> None:
        super().__init__("gw:1", ["e0:1"], None, lambda: True, lambda i: True)

    async def _call(self, method, request):
        if isinstance(request, health_pb2.HealthCheckRequest):
            return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)
        if isinstance(request, engine_pb2.GetLoadRequest):
            return LOAD
        return engine_pb2.GetStatusResponse(loop_alive=True, workers=[engine_pb2.WorkerStatus(rank=0)])


def test_each_engine_lists_its_kv_cache_groups():
    snapshot = asyncio.run(_Collector().snapshot())
    (engine,) = snapshot.engines
    assert engine.kv_cache_usage == 0.4 and engine.num_running == 2
    assert engine.kv_cache_groups == [{"name": "full", "num_blocks": 30, "usage": 0.3},
                                      {"name": "sliding_window_16", "num_blocks": 10, "usage": 0.1}]
    answer = MessageToDict(snapshot_to_pb(snapshot).engines[0], preserving_proto_field_name=True)
    assert answer["kv_cache_groups"] == engine.kv_cache_groups  # what GET /v1/status shows


def test_an_engine_that_does_not_answer_lists_no_groups():
    class Silent(_Collector):
        async def _call(self, method, request):
            return None

    (engine,) = asyncio.run(Silent().snapshot()).engines
    assert engine.kv_cache_groups == []
