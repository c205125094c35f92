"""The KV cache groups on the engine's wire: ``GetInfo`` names each planned group (kind, window,
layers) and ``GetLoad`` each group's blocks and share of the pool."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from types import SimpleNamespace

from gridserve.api.engine.v1 import engine_pb2
from gridserve.services.engine.servicer import EngineServicer
from gridserve.shared.config import GridserveConfig
from gridserve.shared.kv_cache_spec import FULL, SLIDING_WINDOW, KVCacheConfig, KVCacheGroup
from gridserve.shared.load import EngineLoad

PLAN = KVCacheConfig(101, 16, (KVCacheGroup(FULL, ("l0", "l2")), KVCacheGroup(SLIDING_WINDOW, ("l1", "l3"), 16)))


def _servicer(load: EngineLoad) -> EngineServicer:
    def answered() -> Future:
        future: Future = Future()
        future.set_result(load)
        return future

    servicer = EngineServicer(GridserveConfig())
    servicer.loop = SimpleNamespace(core=SimpleNamespace(kv_cache_config=PLAN), load=answered)
    return servicer


def test_get_info_lists_the_planned_groups_and_none_while_the_engine_starts():
    info = asyncio.run(_servicer(EngineLoad(0, 0, 0.0)).GetInfo(engine_pb2.GetInfoRequest(), None))
    assert [(g.name, g.kind, g.sliding_window, g.num_layers) for g in info.kv_cache_groups] == [
        ("full", "full", 0, 2), ("sliding_window_16", "sliding_window", 16, 2)]
    starting = asyncio.run(EngineServicer(GridserveConfig()).GetInfo(engine_pb2.GetInfoRequest(), None))
    assert list(starting.kv_cache_groups) == []


def test_get_load_gives_each_groups_blocks_and_share_of_the_pool():
    load = EngineLoad(1, 2, 0.4, kv_free_blocks=60, kv_total_blocks=100,
                      kv_cache_groups=(("full", 30), ("sliding_window_16", 10)))
    response = asyncio.run(_servicer(load).GetLoad(engine_pb2.GetLoadRequest(), None))
    assert response.kv_total_blocks == 100 and response.kv_cache_usage == 0.4
    assert [(g.name, g.num_blocks, g.usage) for g in response.kv_cache_groups] == [
        ("full", 30, 0.3), ("sliding_window_16", 10, 0.1)]
    empty = asyncio.run(_servicer(EngineLoad(0, 0, 0.0, kv_cache_groups=(("full", 0),))).GetLoad(
        engine_pb2.GetLoadRequest(), None))
    assert [(g.name, g.usage) for g in empty.kv_cache_groups] == [("full", 0.0)]  # no pool yet: no division
