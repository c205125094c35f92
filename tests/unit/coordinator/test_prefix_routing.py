"""Cache-aware routing (``--routing-policy prefix``): the router's rule, the coordinator's copies of
the engines' digests, and the gateway's hashing of a request's prompt."""

from __future__ import annotations

import asyncio
import time

import pytest

from gridserve.services.coordinator.load_table import DigestGapError, Entry, LoadTable
from gridserve.services.engine.kv_cache_manager import KVCacheManager
from gridserve.services.engine.request import Request
from gridserve.services.gateway.lora import Adapter, AdapterTable
from gridserve.services.gateway.processor import ProcessedPrompt
from gridserve.services.gateway.router import EXPECT_S, PREFIX_LOAD_SLACK, Router
from gridserve.services.gateway.service import GatewayService
from gridserve.shared.errors import InvalidArgumentError
from gridserve.shared.load import EngineLoad
from gridserve.shared.lora import LoRARequest
from gridserve.shared.prefix_digest import DigestUpdate, PrefixDigest
from gridserve.shared.prefix_hash import digest_key
from gridserve.shared.sampling_params import SamplingParams
from tests.unit.gateway.fake_engine_client import FakeEngineClient

IDLE = EngineLoad(0, 0, 0.0)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _digest(keys, epoch: int = 1, seq: int = 1, capacity: int = 1000) -> DigestUpdate:
    return DigestUpdate(epoch, seq, reset=True, stored=tuple(keys), block_size=16, capacity=capacity)


def _router(n: int = 3, clock: Clock | None = None) -> Router:
    router = Router(n, "prefix", clock or Clock())
    for rank in range(n):
        router.on_report(rank, IDLE)
        assert router.on_digest(rank, _digest([], epoch=rank + 1))
    return router


def test_the_engine_holding_the_longest_prefix_wins():
    router = _router()
    router.on_digest(0, DigestUpdate(1, 2, 1, stored=(10,), block_size=16, capacity=1000))
    router.on_digest(2, DigestUpdate(3, 2, 1, stored=(10, 11, 12), block_size=16, capacity=1000))
    assert router.block_size == 16
    for _ in range(3):  # whatever the rotation
        assert router.choose([True] * 3, [0, 0, 0], prefix_keys=[10, 11, 12, 13]) == 2
    assert router.choose([True, True, False], [0, 0, 0], prefix_keys=[10, 11, 12]) == 0  # 2 is not ready


def test_a_prefix_counts_only_from_the_first_block():
    router = _router(2)
    router.on_digest(1, DigestUpdate(2, 2, 1, stored=(11, 12, 13), block_size=16, capacity=1000))
    router.on_report(1, EngineLoad(0, 1, 0.0))  # a little busier, and it lacks block 0: load decides
    assert router.choose([True, True], [0, 0], prefix_keys=[10, 11, 12, 13]) == 0


def test_load_beyond_the_slack_overrides_the_cached_prefix():
    router = _router(2)
    router.on_digest(0, DigestUpdate(1, 2, 1, stored=(10, 11), block_size=16, capacity=1000))
    router.on_report(0, EngineLoad(0, int(PREFIX_LOAD_SLACK), 0.0))  # exactly at the slack: still it
    assert router.choose([True, True], [0, 0], prefix_keys=[10, 11]) == 0
    router.on_report(0, EngineLoad(1, int(PREFIX_LOAD_SLACK), 0.0))  # one queued more: too far
    assert router.choose([True, True], [0, 0], prefix_keys=[10, 11]) == 1


def test_an_explicit_rank_wins_over_the_prefix():
    router = _router(2)
    router.on_digest(0, DigestUpdate(1, 2, 1, stored=(10, 11), block_size=16, capacity=1000))
    assert router.choose([True, True], [0, 0], data_parallel_rank=1, prefix_keys=[10, 11]) == 1


def test_unknown_digests_fall_back_to_load():
    router = Router(2, "prefix", Clock())
    assert router.block_size is None  # no digest yet: the gateway does not even hash the prompt
    router.on_report(0, EngineLoad(0, 5, 0.0))
    router.on_report(1, EngineLoad(0, 0, 0.0))
    assert router.choose([True, True], [0, 0], prefix_keys=[10, 11]) == 1
    router.on_digest(0, _digest([10, 11]))
    router.on_digest(1, _digest([], epoch=2))
    assert router.choose([True, True], [0, 0], prefix_keys=[10, 11]) == 0
    # A gap empties engine 0's copy until a reset: it holds nothing as far as routing knows.
    assert not router.on_digest(0, DigestUpdate(1, 5, 4, stored=(12,), block_size=16, capacity=1000))
    assert router.choose([True, True], [0, 0], prefix_keys=[10, 11]) == 1
    router.forget_digest(1)
    router.forget_digest(0)
    assert router.block_size is None


def test_the_load_policy_ignores_prefixes():
    router = Router(2, "load")
    router.on_report(0, EngineLoad(0, 3, 0.0))
    router.on_report(1, IDLE)
    router.on_digest(0, _digest([10, 11]))
    assert router.block_size is None
    assert router.choose([True, True], [0, 0], prefix_keys=[10, 11]) == 1
    with pytest.raises(InvalidArgumentError):
        Router(2, "random")


def test_a_burst_sharing_a_new_prefix_follows_the_first_request_until_the_engine_publishes_it():
    clock = Clock()
    router = _router(3, clock)
    first = router.choose([True] * 3, [0, 0, 0], prefix_keys=[20, 21, 22])
    router.on_report(first, EngineLoad(0, 1, 0.0))  # it runs the first; its digest lacks the blocks yet
    for _ in range(3):  # what this gateway sent there counts as held there
        assert router.choose([True] * 3, [0, 0, 0], prefix_keys=[20, 21, 22, 23]) == first
    clock.now += EXPECT_S + 1  # the engine never said it holds them: the guess expires
    assert router.choose([True] * 3, [0, 0, 0], prefix_keys=[20, 21, 22]) != first


def test_an_eviction_the_engine_publishes_ends_the_expectation():
    clock = Clock()
    router = _router(2, clock)
    first = router.choose([True, True], [0, 0], prefix_keys=[30, 31])
    other = 1 - first
    router.on_report(first, EngineLoad(0, 1, 0.0))
    router.on_digest(first, DigestUpdate(first + 1, 2, 1, removed=(30,), block_size=16, capacity=1000))
    assert router.choose([True, True], [0, 0], prefix_keys=[30, 31]) == other


def test_the_coordinator_keeps_a_copy_per_engine_and_gives_each_watcher_what_it_lacks():
    async def scenario() -> None:
        table = LoadTable()
        engine = PrefixDigest(16, 64)
        table.update(Entry(0, "a:1", IDLE), engine.since(None))
        watcher = table.digest_since(0, None)
        assert watcher.reset and watcher.stored == ()
        version = table.snapshot()[0]
        engine.block_stored((5).to_bytes(8, "little"))
        engine.commit()
        table.update(Entry(0, "a:1", IDLE), engine.since((engine.epoch, 0)))  # same load, a new digest
        assert table.snapshot()[0] > version  # watchers wake for it
        update = table.digest_since(0, watcher.cursor)
        assert not update.reset and update.stored == (5,)
        assert table.digest_since(0, update.cursor) is None
        with pytest.raises(DigestGapError):
            table.update(Entry(0, "a:1", IDLE), DigestUpdate(engine.epoch, 9, 7, stored=(6,), block_size=16,
                                                             capacity=64))
        table.remove(0)
        assert table.digest_since(0, None) is None

    asyncio.run(scenario())


def test_the_gateway_hashes_a_lora_request_as_its_engine_does():
    tokens = list(range(100, 140))
    engine_request = Request("r", tokens, SamplingParams(max_tokens=4), lora_request=LoRARequest("sql", 3, "/a/sql"))
    manager = KVCacheManager(num_blocks=16, block_size=16)
    manager.get_computed_blocks(engine_request)  # hashes the request's full blocks
    engine_keys = [digest_key(h) for h in engine_request.block_hashes]

    async def scenario() -> None:
        service = GatewayService(object(), [FakeEngineClient("e0"), FakeEngineClient("e1")], "m", 512, 1000, 20,
                                 routing_policy="prefix")
        prompt = ProcessedPrompt(None, tokens, SamplingParams(max_tokens=4))
        assert service._prefix_keys(prompt, None) == []  # no digest yet: no block size to hash with
        service.router.on_digest(1, DigestUpdate(1, 1, reset=True, stored=tuple(engine_keys), block_size=16,
                                                 capacity=100))
        service.loras.table = AdapterTable({"sql": Adapter("sql", "/a/sql", 3)}, True, 1, 16, time.monotonic())
        keys = service._prefix_keys(prompt, "sql")
        assert keys == engine_keys and len(keys) == 2
        assert service._prefix_keys(prompt, None) != engine_keys  # the base model's blocks are others
        assert service._prefix_keys(prompt, "unknown") == []
        assert service.engines.index(service._pick_engine(prefix_keys=keys)) == 1
        service.blocking.shutdown()

    asyncio.run(scenario())
