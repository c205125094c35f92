"""``gridserve bench chaos`` without processes: the per-stream checks, the time streams resumed,
what counts as differing because of a fault, and the fault thread's choice of victim (never the
last serving engine, never a role still restarting)."""

from __future__ import annotations

import random
from types import SimpleNamespace

from gridserve.benchmarks.chaos import (
    ChaosRequest,
    FaultInjector,
    Progress,
    StreamResult,
    _differing,
    judge,
    longest_pause,
    make_requests,
    passed,
    resumed_after,
    stream_faults,
)


def _result(index, tokens, times=(), start=0.0, end=10.0, usage=None):
    return StreamResult(index, text="".join(tokens), tokens=list(tokens), chunk_times=list(times),
                        usage=usage if usage is not None else {"completion_tokens": len(tokens)},
                        finish_reason="length", done=True, start=start, end=end)


def test_requests_alternate_greedy_and_seeded_with_a_fixed_length():
    requests = make_requests(4, 8)
    assert [(r.temperature, r.seed) for r in requests] == [(0.0, None), (0.9, 1001), (0.0, None), (0.9, 1003)]
    body = requests[1].body("m")
    assert body["min_tokens"] == body["max_tokens"] == 8 and body["ignore_eos"] and body["seed"] == 1001


def test_a_stream_with_a_missing_or_duplicated_chunk_or_wrong_usage_is_flagged():
    request = ChaosRequest(0, "p", 3)
    assert stream_faults(_result(0, ["a", "b", "c"]), request) == []
    assert stream_faults(_result(0, ["a", "b"]), request) != []  # one missing
    assert stream_faults(_result(0, ["a", "b", "b", "c"]), request) != []  # one twice
    assert stream_faults(_result(0, ["a", "b", "c"], usage={"completion_tokens": 4}), request) != []


def test_streams_resumed_is_the_slowest_in_flight_stream_s_next_token():
    streams = [_result(0, "abc", [1.0, 2.0, 2.5]), _result(1, "abc", [1.5, 1.6, 4.0]),
               _result(2, "abc", [3.0, 3.1, 3.2])]  # started after the kill: not counted
    assert resumed_after(streams, 1.8) == 4.0 - 1.8
    assert resumed_after(streams, 9.0) is None
    assert longest_pause(streams, 1.8) == 4.0 - 1.6  # stream 1's gap across the kill
    assert longest_pause(streams, 9.0) is None


def test_differing_names_where_outputs_part_and_the_faults_in_flight():
    clean = [_result(0, "abc"), _result(1, "abc", start=0.0, end=5.0)]
    other = [_result(0, "abc"), _result(1, "abd", start=0.0, end=5.0)]
    faults = [{"role": "engine", "kill_time": 2.0}, {"role": "coordinator", "kill_time": 7.0}]
    assert _differing(clean, other, faults) == {1: {"token": 2, "faults_in_flight": ["engine"]}}


def _proc(role, group=None, address=None, alive=True):
    process = SimpleNamespace(poll=lambda: None if alive else -9)
    return SimpleNamespace(role=role, group=group, address=address or f"{role}-{group}", pid=id(process),
                           process=process)


def test_the_last_serving_engine_and_restarting_roles_are_never_chosen():
    procs = [_proc("coordinator"), _proc("worker", 0), _proc("engine", 0), _proc("worker", 1), _proc("engine", 1)]
    injector = FaultInjector(SimpleNamespace(processes=procs), ["engine", "worker", "coordinator"], 3, 10,
                             Progress(), random.Random(0))
    assert {p.role for p in (injector._pick() for _ in range(50))} == {"engine", "worker", "coordinator"}
    # engine 0's group was killed and is restarting: neither engine group may be chosen now
    injector.faults.append({"address": "engine-0", "group": 0, "pid": 1, "role": "engine"})
    assert {injector._pick().role for _ in range(20)} == {"coordinator"}
    injector.faults.append({"address": "coordinator-None", "group": None, "pid": 2, "role": "coordinator"})
    assert injector._pick() is None
    injector.faults[0]["restart_s"] = 12.0  # engine 0 serves again
    assert injector._pick().role in ("engine", "worker")


def test_only_greedy_streams_an_engine_fault_struck_can_fail_the_run():
    requests = make_requests(6, 4)  # even indices greedy, odd seeded
    differing = {0: {"token": 1, "faults_in_flight": ["engine"]}, 1: {"token": 1, "faults_in_flight": ["worker"]},
                 2: {"token": 1, "faults_in_flight": ["coordinator"]}, 3: {"token": 2, "faults_in_flight": []},
                 4: {"token": 1, "faults_in_flight": ["engine"]}}
    verdict = judge(requests, differing, baseline={4: {}})
    assert verdict == {"differing_greedy": [0, 2, 4], "differing_under_fault": [0, 1],
                       "greedy_differing_under_fault": [0]}


def test_with_batch_invariant_engines_every_differing_output_fails_the_run():
    clean = {"failed": 0, "bad_streams": 0, "differing": 0, "baseline_differing": {},
             "greedy_differing_under_fault": []}
    seeded_differs = {**clean, "differing": 1}  # a seeded stream, no fault in flight
    baseline_differs = {**clean, "baseline_differing": {3: {"token": 5, "faults_in_flight": []}}}
    for report in (clean, seeded_differs, baseline_differs):
        assert passed(report)  # engines not batch-invariant: only struck greedy streams count
    assert passed({**clean, "batch_invariant": True})
    assert not passed({**seeded_differs, "batch_invariant": True})
    assert not passed({**baseline_differs, "batch_invariant": True})
    assert not passed({**clean, "greedy_differing_under_fault": [0]})
    assert not passed({**clean, "failed": 1, "batch_invariant": True})
