"""Data-parallel engine choice (services/gateway/router.py) and the coordinator's load table."""

from __future__ import annotations

import threading
import time

import pytest

from gridserve.services.coordinator.load_table import EngineLoad, LoadTable
from gridserve.services.gateway.router import ReportedLoad, Router, engine_score
from gridserve.shared.errors import EngineDeadError, InvalidArgumentError


def test_score_weighs_queue_over_running_and_penalises_a_full_kv_cache():
    assert engine_score(ReportedLoad(1, 0, 0.0), 0, 0) == 4
    assert engine_score(ReportedLoad(0, 3, 0.0), 0, 0) == 3
    assert engine_score(ReportedLoad(0, 3, 0.5), 0, 0) == 3  # no penalty up to one half
    assert engine_score(ReportedLoad(0, 3, 1.0), 0, 0) == 3 + 16
    assert engine_score(ReportedLoad(0, 0, 0.0), 2, 9) == 8  # sent since the report count as queued
    assert engine_score(ReportedLoad(0, 0, 0.0), 2, 1) == 4  # ... while they are in flight
    assert engine_score(None, 2, 5) == 5  # never reported: this gateway's in-flight count


def test_new_requests_go_to_the_less_loaded_engine():
    router = Router(2)
    router.on_report(0, ReportedLoad(num_waiting=3, num_running=20, kv_cache_usage=0.4))
    router.on_report(1, ReportedLoad(num_waiting=0, num_running=2, kv_cache_usage=0.1))
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
    router.on_report(1, ReportedLoad(50, 50, 0.9))
    assert router.choose([True, True], [0, 0], data_parallel_rank=1) == 1
    with pytest.raises(InvalidArgumentError) as err:
        router.choose([True, True], [0, 0], data_parallel_rank=2)
    assert err.value.field == "data_parallel_rank"
    with pytest.raises(EngineDeadError):
        router.choose([True, False], [0, 0], data_parallel_rank=1)


def test_load_table_wakes_watchers_on_change_only():
    table = LoadTable()
    version, loads = table.snapshot()
    assert loads == []
    start = time.monotonic()
    assert table.wait_for_change(version, timeout=0.1)[0] == version  # nothing changed: the timeout
    assert time.monotonic() - start >= 0.1
    woke = []
    waiter = threading.Thread(target=lambda: woke.append(table.wait_for_change(version, timeout=10)))
    waiter.start()
    table.update(EngineLoad(1, "b:2", 0, 1, 0.5))
    table.update(EngineLoad(0, "a:1", 2, 0, 0.0))
    waiter.join(timeout=5)
    assert woke and woke[0][0] > version
    version, loads = table.snapshot()
    assert [x.dp_rank for x in loads] == [0, 1]
    table.update(EngineLoad(0, "a:1", 2, 0, 0.0, reported_at=5.0))  # same numbers: no new version
    assert table.snapshot()[0] == version
    table.remove(1)
    assert [x.dp_rank for x in table.snapshot()[1]] == [0]
    table.bump()
    assert table.snapshot()[0] > version


def test_waves_barrier_reduces_unfinished_and_ends_the_wave():
    from concurrent.futures import ThreadPoolExecutor

    from gridserve.services.coordinator.waves import WaveError, Waves

    changes = []
    waves = Waves(2, on_change=lambda: changes.append(waves.state()), timeout_s=5)
    assert waves.start() == 0 and waves.start() == 0  # a second start while running is a no-op
    assert waves.state() == (0, True) and len(changes) == 1
    with ThreadPoolExecutor(2) as pool:
        # Step 0: rank 0 still has work, rank 1 ran a dummy step: both go on.
        busy = pool.submit(waves.sync, 0, 0, 0, True)
        idle = pool.submit(waves.sync, 1, 0, 0, False)
        assert busy.result(timeout=5) is True and idle.result(timeout=5) is True
        # Step 1: nobody has work: the wave ends for both, the number advances.
        results = [pool.submit(waves.sync, r, 0, 1, False) for r in (0, 1)]
        assert [f.result(timeout=5) for f in results] == [False, False]
    assert waves.state() == (1, False)
    with pytest.raises(WaveError):
        waves.sync(0, 0, 2, True)  # wave 0 is over
    assert waves.start() == 1
    short = Waves(2, timeout_s=0.2)
    short.start()
    with pytest.raises(WaveError, match="only ranks \\[0\\]"):
        short.sync(0, 0, 0, True)  # rank 1 never comes: no hang, the wave ends
    assert short.state() == (1, False)
