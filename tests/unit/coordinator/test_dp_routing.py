"""Data-parallel engine choice (services/gateway/router.py) and the coordinator's load table."""

from __future__ import annotations

import asyncio
import time

import pytest

from gridserve.services.coordinator.load_table import Entry, LoadTable
from gridserve.services.gateway.router import Router, engine_score
from gridserve.shared.errors import EngineDeadError, InvalidArgumentError
from gridserve.shared.load import EngineLoad


def test_score_weighs_queue_over_running_and_penalises_a_full_kv_cache():
    assert engine_score(EngineLoad(1, 0, 0.0), 0, 0) == 4
    assert engine_score(EngineLoad(0, 3, 0.0), 0, 0) == 3
    assert engine_score(EngineLoad(0, 3, 0.5), 0, 0) == 3  # no penalty up to one half
    assert engine_score(EngineLoad(0, 3, 1.0), 0, 0) == 3 + 16
    assert engine_score(EngineLoad(0, 0, 0.0), 2, 9) == 8  # sent since the report count as queued
    assert engine_score(EngineLoad(0, 0, 0.0), 2, 1) == 4  # ... while they are in flight
    assert engine_score(None, 2, 5) == 5  # never reported: this gateway's in-flight count


def test_new_requests_go_to_the_less_loaded_engine():
    router = Router(2)
    router.on_report(0, EngineLoad(num_waiting=3, num_running=20, kv_cache_usage=0.4))
    router.on_report(1, EngineLoad(num_waiting=0, num_running=2, kv_cache_usage=0.1))
    in_flight = [0, 0]
    picks = []
    for _ in range(5):
        picks.append(router.choose([True, True], in_flight))
        in_flight[picks[-1]] += 1
    # Engine 1 takes requests until what it was sent since its report outweighs engine 0's load.
    assert picks == [1, 1, 1, 1, 1]
    assert router.routed == [0, 5]


def test_ties_rotate_and_unready_engines_are_skipped():
    router = Router(3)
    picks = [router.choose([True, True, True], [0, 0, 0]) for _ in range(3)]
    assert sorted(picks) == [0, 1, 2]
    assert router.choose([True, True, True], [2, 0, 1]) == 1  # no reports: fewest in flight here
    assert {router.choose([False, True, False], [0, 0, 0]) for _ in range(4)} == {1}
    with pytest.raises(EngineDeadError):
        router.choose([False, False, False], [0, 0, 0])


def test_explicit_rank_wins_and_is_validated():
    router = Router(2)
    router.on_report(1, EngineLoad(50, 50, 0.9))
    assert router.choose([True, True], [0, 0], data_parallel_rank=1) == 1
    with pytest.raises(InvalidArgumentError) as err:
        router.choose([True, True], [0, 0], data_parallel_rank=2)
    assert err.value.field == "data_parallel_rank"
    with pytest.raises(EngineDeadError):
        router.choose([True, False], [0, 0], data_parallel_rank=1)


def _entry(rank: int, address: str, waiting: int, running: int, usage: float, at: float = 0.0) -> Entry:
    return Entry(rank, address, EngineLoad(waiting, running, usage), at)


def test_load_table_wakes_watchers_on_change_only():
    async def scenario() -> None:
        table = LoadTable()
        version, loads = table.snapshot()
        assert loads == []
        start = time.monotonic()
        assert (await table.wait_for_change(version, timeout=0.1))[0] == version  # nothing changed
        assert time.monotonic() - start >= 0.1
        waiter = asyncio.ensure_future(table.wait_for_change(version, timeout=10))
        await asyncio.sleep(0)
        table.update(_entry(1, "b:2", 0, 1, 0.5))
        table.update(_entry(0, "a:1", 2, 0, 0.0))
        woke = await asyncio.wait_for(waiter, 5)
        assert woke[0] > version
        version, loads = table.snapshot()
        assert [x.dp_rank for x in loads] == [0, 1]
        table.update(_entry(0, "a:1", 2, 0, 0.0, at=5.0))  # same numbers: no new version
        assert table.snapshot()[0] == version
        table.remove(1)
        assert [x.dp_rank for x in table.snapshot()[1]] == [0]
        table.bump()
        assert table.snapshot()[0] > version

    asyncio.run(scenario())


def test_waves_barrier_reduces_unfinished_and_ends_the_wave():
    from gridserve.services.coordinator.waves import WaveError, Waves

    async def scenario() -> None:
        changes = []
        waves = Waves(2, on_change=lambda: changes.append(waves.state()), timeout_s=5)
        assert waves.start() == 0 and waves.start() == 0  # a second start while running is a no-op
        assert waves.state() == (0, True) and len(changes) == 1
        # Step 0: rank 0 still has work, rank 1 ran a dummy step: both go on.
        busy, idle = await asyncio.wait_for(asyncio.gather(waves.sync(0, 0, 0, True), waves.sync(1, 0, 0, False)), 5)
        assert busy is True and idle is True
        # Step 1: nobody has work: the wave ends for both, the number advances.
        results = await asyncio.wait_for(asyncio.gather(*(waves.sync(r, 0, 1, False) for r in (0, 1))), 5)
        assert results == [False, False]
        assert waves.state() == (1, False)
        with pytest.raises(WaveError):
            await waves.sync(0, 0, 2, True)  # wave 0 is over
        assert waves.start() == 1
        short = Waves(2, timeout_s=0.2)
        short.start()
        with pytest.raises(WaveError, match="only ranks \\[0\\]"):
            await short.sync(0, 0, 0, True)  # rank 1 never comes: no hang, the wave ends
        assert short.state() == (1, False)

    asyncio.run(scenario())
