"""Admission control in the scheduler: ``max_waiting_requests`` refuses new requests with
``ResourceExhaustedError`` (RESOURCE_EXHAUSTED / HTTP 429), and a continuation (``admit_always``,
a request resubmitted after its engine died) is never refused and is queued ahead of new requests."""

from __future__ import annotations

import grpc
import pytest

from gridserve.services.engine.kv_cache_manager import KVCacheManager
from gridserve.services.engine.request import Request
from gridserve.services.engine.scheduler import Scheduler
from gridserve.shared.config import GridserveConfig, ModelConfig, SchedulerConfig
from gridserve.shared.errors import ConfigError, ResourceExhaustedError
from gridserve.shared.rpc.errors import status_for
from gridserve.shared.sampling_params import SamplingParams
from gridserve.shared.scheduler_output import ModelRunnerOutput


def _scheduler(max_waiting: int | None, max_num_seqs: int = 1) -> Scheduler:
    config = GridserveConfig(model=ModelConfig(max_model_len=256),
                             scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64,
                                                       max_waiting_requests=max_waiting))
    return Scheduler(config, KVCacheManager(64, 16, True))


def _request(rid: str, admit_always: bool = False) -> Request:
    return Request(rid, [5, 6, 7], SamplingParams(max_tokens=4), eos_token_id=2, admit_always=admit_always)


def _step(s: Scheduler) -> None:
    out = s.schedule()
    ids = list(out.num_scheduled_tokens)
    s.update_from_output(out, ModelRunnerOutput(req_ids=ids, sampled_token_ids=[9] * len(ids),
                                                logprobs=[None] * len(ids)))


def test_new_requests_beyond_the_waiting_limit_are_refused_and_admitted_once_it_drains():
    s = _scheduler(max_waiting=2)
    s.add_request(_request("a"))
    s.add_request(_request("b"))
    with pytest.raises(ResourceExhaustedError, match="max-waiting-requests 2"):
        s.add_request(_request("c"))
    assert "c" not in s.requests and len(s.waiting) == 2  # nothing of it is left behind
    _step(s)  # "a" starts running (max_num_seqs 1): one waiting place frees up
    s.add_request(_request("c"))
    assert [r.request_id for r in s.waiting] == ["b", "c"]


def test_without_a_flag_the_queue_takes_the_default_limit():
    s = _scheduler(max_waiting=None)
    for i in range(100):
        s.add_request(_request(str(i)))
    assert len(s.waiting) == 100 and s.max_waiting_requests == 1024  # max(1024, 4 x max_num_seqs)


def test_a_continuation_is_never_refused_and_goes_ahead_of_new_requests():
    s = _scheduler(max_waiting=2)
    s.add_request(_request("new-1"))
    s.add_request(_request("new-2"))
    s.add_request(_request("cont-1", admit_always=True))  # the queue is full: admitted anyway
    s.add_request(_request("cont-2", admit_always=True))
    assert [r.request_id for r in s.waiting] == ["cont-1", "cont-2", "new-1", "new-2"]
    with pytest.raises(ResourceExhaustedError):
        s.add_request(_request("new-3"))
    _step(s)  # the first continuation runs first
    assert [r.request_id for r in s.running] == ["cont-1"]


def test_a_continuation_queues_behind_preempted_requests():
    s = _scheduler(max_waiting=1, max_num_seqs=4)
    s.add_request(_request("running"))
    _step(s)
    victim = s.running.pop()
    s._preempt(victim)  # back at the front of the queue, as the scheduler does when KV runs out
    s.add_request(_request("cont", admit_always=True))
    assert [r.request_id for r in s.waiting] == ["running", "cont"]


def test_refusal_maps_to_resource_exhausted():
    assert status_for(ResourceExhaustedError("full"))[0] == grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.mark.parametrize("value", [0, -1])
def test_a_nonpositive_limit_is_a_config_error_naming_the_field(value):
    with pytest.raises(ConfigError, match="scheduler.max_waiting_requests"):
        SchedulerConfig(max_waiting_requests=value)
