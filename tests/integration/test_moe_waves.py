"""MoE request waves at DP=2 with the recipe's tiny Mixtral: real engines, workers, coordinator.

A request on one engine runs while the other engine keeps in lockstep with dummy steps; the wave
ends for both at the same step and the coordinator's wave number advances; requests arriving at
both engines at once all finish (no barrier deadlock).
"""

from __future__ import annotations

import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gridserve.api.coordinator.v1 import coordinator_pb2, coordinator_pb2_grpc

from .services import deployment, gateway_stub, greedy, token_prompt

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def moe(mixtral_tiny, tmp_path_factory):
    with deployment(mixtral_tiny, tmp_path_factory.mktemp("logs"), data_parallel_size=2) as launcher:
        yield launcher


def _counter(engine, name: str) -> float:
    with urllib.request.urlopen(f"http://{engine.metrics_address}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    for family in text_string_to_metric_families(text):
        if family.name == name:
            return sum(s.value for s in family.samples if s.name.endswith("_total"))
    raise AssertionError(f"{name} not in the engine's metrics")


def _wave(launcher) -> tuple[int, bool]:
    coordinator = next(p for p in launcher.processes if p.role == "coordinator")
    with grpc.insecure_channel(coordinator.address) as channel:
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        first = next(iter(stub.WatchLoad(coordinator_pb2.WatchLoadRequest(subscriber_id="test"), timeout=10)))
    return first.wave, first.wave_running


def _wave_after(launcher, before: int, within_s: float = 15.0) -> tuple[int, bool]:
    """The coordinator's wave once the wave that was running has ended: the last token reaches the
    client at the step that finishes its request, the barrier that ends the wave comes a step later."""
    deadline = time.monotonic() + within_s
    wave, running = _wave(launcher)
    while (wave <= before or running) and time.monotonic() < deadline:
        time.sleep(0.1)
        wave, running = _wave(launcher)
    return wave, running


def _generate(launcher, prompt: list[int], max_tokens: int, rank: int) -> list[int]:
    with grpc.insecure_channel(launcher.gateway_addresses[0]) as channel:
        request = token_prompt(prompt, greedy(max_tokens))
        request.data_parallel_rank = rank
        return [t for r in gateway_stub(channel).Generate(request, timeout=120) for t in r.token_ids]


def test_one_request_runs_while_the_idle_engine_steps_in_lockstep(moe):
    engines = [p for p in moe.processes if p.role == "engine"]
    wave_before, _ = _wave(moe)
    dummy_before = [_counter(e, "gridserve:wave_dummy_steps") for e in engines]
    assert len(_generate(moe, [5, 17, 300, 42], 12, rank=0)) == 12
    dummy = [_counter(e, "gridserve:wave_dummy_steps") - b for e, b in zip(engines, dummy_before)]
    assert dummy[0] == 0 and dummy[1] >= 10, dummy  # engine 1 had nothing to do but kept pace
    wave, running = _wave_after(moe, wave_before)
    assert wave > wave_before and not running
    waves = [_counter(e, "gridserve:waves_completed") for e in engines]
    assert waves[0] == waves[1] == wave  # both took part in every wave


def test_requests_at_both_engines_at_once_all_finish(moe):
    wave_before, _ = _wave(moe)
    with ThreadPoolExecutor(max_workers=8) as pool:
        futures = [pool.submit(_generate, moe, [7 + i, 40, 41], 6 + i % 5, i % 2) for i in range(8)]
        lengths = [f.result(timeout=120) for f in futures]
    assert [len(x) for x in lengths] == [6 + i % 5 for i in range(8)]
    wave, running = _wave_after(moe, wave_before)
    assert wave > wave_before and not running
