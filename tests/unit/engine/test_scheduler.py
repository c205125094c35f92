"""Scheduler behaviour with a real KV-cache manager and a fake worker (no torch)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gridserve.services.engine.kv_cache_manager import KVCacheManager
from gridserve.services.engine.request import Request, RequestStatus
from gridserve.services.engine.scheduler import Scheduler
from gridserve.shared.config import GridserveConfig, ModelConfig, SchedulerConfig
from gridserve.shared.outputs import FinishReason
from gridserve.shared.sampling_params import SamplingParams
from gridserve.shared.scheduler_output import ModelRunnerOutput, SchedulerOutput

EOS = 2


def make_scheduler(num_blocks=64, max_num_seqs=8, budget=64, chunked=True, caching=True, max_model_len=512):
    config = GridserveConfig(
        model=ModelConfig(max_model_len=max_model_len),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                  enable_chunked_prefill=chunked),
    )
    return Scheduler(config, KVCacheManager(num_blocks, 16, caching))


def make_request(rid, n_prompt, max_tokens=4, first_token=100, **kw) -> Request:
    prompt = list(range(first_token, first_token + n_prompt))
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **kw), eos_token_id=EOS)


def run_step(s: Scheduler, token: int = 7) -> tuple[SchedulerOutput, list]:
    """Schedule, then answer like a worker: one token for every request that reached its end."""
    out = s.schedule()
    sampled = [rid for rid in out.num_scheduled_tokens
               if s.requests.get(rid) and s.requests[rid].num_computed_tokens >= s.requests[rid].num_tokens]
    result = ModelRunnerOutput(req_ids=sampled, sampled_token_ids=[token] * len(sampled),
                               logprobs=[None] * len(sampled))
    return out, s.update_from_output(out, result)


def test_token_budget_caps_each_step_and_chunks_long_prompts():
    s = make_scheduler(budget=32)
    s.add_request(make_request("a", 50))
    out, outputs = run_step(s)
    assert out.num_scheduled_tokens == {"a": 32} and outputs == []
    out, outputs = run_step(s)
    assert out.num_scheduled_tokens == {"a": 18}
    assert [o.new_token_ids for o in outputs] == [[7]]


def test_decodes_of_running_requests_go_before_new_prefills():
    s = make_scheduler(budget=20)
    s.add_request(make_request("a", 10))
    run_step(s)
    s.add_request(make_request("b", 40))
    out, _ = run_step(s)
    assert list(out.num_scheduled_tokens.items()) == [("a", 1), ("b", 19)]


def test_waiting_requests_are_admitted_first_come_first_served():
    s = make_scheduler(budget=16, max_num_seqs=8)
    for rid in "abc":
        s.add_request(make_request(rid, 10, first_token=ord(rid) * 100))
    out, _ = run_step(s)
    assert list(out.num_scheduled_tokens) == ["a", "b"]
    assert out.num_scheduled_tokens == {"a": 10, "b": 6}


def test_max_num_seqs_caps_running_requests():
    s = make_scheduler(budget=512, max_num_seqs=2)
    for rid in "abc":
        s.add_request(make_request(rid, 5, first_token=ord(rid) * 100))
    out, _ = run_step(s)
    assert set(out.num_scheduled_tokens) == {"a", "b"} and len(s.waiting) == 1


def test_without_chunked_prefill_a_prompt_over_budget_waits():
    s = make_scheduler(budget=32, chunked=False)
    s.add_request(make_request("a", 20))
    s.add_request(make_request("b", 20, first_token=500))
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"a": 20}


def test_preemption_frees_the_newest_request_and_it_resumes_with_its_tokens():
    s = make_scheduler(num_blocks=5, budget=256, max_model_len=64)  # 4 usable blocks = 64 tokens
    s.add_request(make_request("old", 30, max_tokens=20, ignore_eos=True))
    s.add_request(make_request("new", 30, max_tokens=20, ignore_eos=True, first_token=900))
    run_step(s)
    preempted_at = None
    for step in range(40):
        out, _ = run_step(s, token=11)
        if "new" in out.finished_req_ids:
            preempted_at = step
            break
    assert preempted_at is not None
    new = s.requests["new"]
    assert new.status == RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert s.waiting[0] is new and s.num_preemptions == 1
    generated = list(new.output_token_ids)
    for _ in range(40):
        out, _ = run_step(s, token=11)
        if new.status == RequestStatus.RUNNING:
            break
    resumed = [r for r in out.scheduled_new_reqs if r.req_id == "new"]
    assert resumed and resumed[0].output_token_ids == generated


def test_abort_is_idempotent_and_frees_blocks():
    s = make_scheduler()
    s.add_request(make_request("a", 40))
    s.add_request(make_request("b", 40, first_token=700))
    run_step(s)
    assert s.abort_requests(["a", "zzz"]) == ["a"]
    assert s.abort_requests(["a"]) == []
    out = s.schedule()
    assert "a" in out.finished_req_ids and "a" not in out.num_scheduled_tokens
    s.abort_requests(["b"])
    assert s.kv.num_free_blocks == s.kv.num_total_blocks and not s.has_unfinished_requests()


@pytest.mark.parametrize(
    ("params", "token", "status", "stop_reason"),
    [
        (dict(max_tokens=1), 7, RequestStatus.FINISHED_LENGTH_CAPPED, None),
        (dict(max_tokens=5), EOS, RequestStatus.FINISHED_STOPPED, None),
        (dict(max_tokens=5, stop_token_ids=[9]), 9, RequestStatus.FINISHED_STOPPED, 9),
        (dict(max_tokens=5, ignore_eos=True), EOS, RequestStatus.RUNNING, None),
        (dict(max_tokens=5, min_tokens=2), EOS, RequestStatus.RUNNING, None),
    ],
)
def test_stop_conditions(params, token, status, stop_reason):
    s = make_scheduler()
    req = Request("a", [100, 101], SamplingParams(**params), eos_token_id=EOS)
    s.add_request(req)
    _, outputs = run_step(s, token=token)
    assert req.status == status and req.stop_reason == stop_reason
    assert (outputs[0].finish_reason is not None) == status.finished


def test_max_model_len_caps_generation():
    s = make_scheduler(max_model_len=12)
    req = make_request("a", 10, max_tokens=100)
    s.add_request(req)
    while s.has_unfinished_requests():
        run_step(s)
    assert req.num_tokens == 12 and req.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_prefix_hit_skips_cached_tokens():
    s = make_scheduler(budget=512)
    s.add_request(make_request("a", 48, max_tokens=1))
    run_step(s)
    s.add_request(make_request("b", 40, max_tokens=1))
    out, _ = run_step(s)
    assert out.num_scheduled_tokens == {"b": 40 - 32}
    assert out.scheduled_new_reqs[0].num_computed_tokens == 32
    assert s.kv.num_free_blocks == s.kv.num_total_blocks


def test_every_finished_request_returns_all_blocks():
    s = make_scheduler(num_blocks=12, budget=48)
    for i in range(10):
        s.add_request(make_request(f"r{i}", 10 + 7 * i, max_tokens=6, first_token=1000 * i))
    while s.has_unfinished_requests():
        run_step(s)
    assert s.kv.num_free_blocks == s.kv.num_total_blocks


def test_engine_side_modules_do_not_import_torch():
    code = (
        "import sys; import gridserve.services.engine.core, gridserve.services.engine.scheduler, "
        "gridserve.services.gateway.processor; print('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def _sample(out: SchedulerOutput, token: int) -> ModelRunnerOutput:
    rids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=rids, sampled_token_ids=[token] * len(rids), logprobs=[None] * len(rids))


def test_next_step_is_scheduled_while_one_is_in_flight_without_passing_max_tokens():
    s = make_scheduler()
    req = make_request("a", 10, max_tokens=3, ignore_eos=True)
    s.add_request(req)
    first = s.schedule()  # prefill: will sample output token 1
    second = s.schedule()  # decodes token 1 before its value is known (the worker has it)
    assert second.num_scheduled_tokens == {"a": 1} and req.num_output_placeholders == 2
    s.update_from_output(first, _sample(first, 7))
    third = s.schedule()
    assert third.num_scheduled_tokens == {"a": 1}
    s.update_from_output(second, _sample(second, 8))
    fourth = s.schedule()  # 2 tokens out + 1 in flight = max_tokens: nothing more
    assert fourth.num_scheduled_tokens == {}
    s.update_from_output(third, _sample(third, 9))
    assert req.output_token_ids == [7, 8, 9] and req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert s.kv.num_free_blocks == s.kv.num_total_blocks


def test_sample_of_a_request_that_stopped_while_in_flight_is_discarded():
    s = make_scheduler()
    req = make_request("a", 10, max_tokens=10)
    s.add_request(req)
    first = s.schedule()
    second = s.schedule()
    outputs = s.update_from_output(first, _sample(first, EOS))
    assert outputs[0].finish_reason is not None and req.status == RequestStatus.FINISHED_STOPPED
    assert s.update_from_output(second, _sample(second, 5)) == []
    assert req.output_token_ids == [EOS]
    assert "a" in s.schedule().finished_req_ids
    assert s.kv.num_free_blocks == s.kv.num_total_blocks


def test_requeue_all_sends_every_request_back_in_order_to_recompute_with_its_tokens():
    s = make_scheduler(budget=128)
    for rid in ("a", "b", "c"):
        s.add_request(make_request(rid, 20, max_tokens=10, first_token=100 + 30 * ord(rid)))
    run_step(s)
    run_step(s)
    s.schedule()  # a step in flight whose samples are lost with the workers
    assert [r.num_output_placeholders for r in s.running] == [1, 1, 1]
    assert s.requeue_all() == 3
    assert [r.request_id for r in s.waiting] == ["a", "b", "c"] and s.running == []
    assert all(r.num_computed_tokens == 0 and r.num_output_placeholders == 0 for r in s.waiting)
    assert s.kv.num_free_blocks == s.kv.num_total_blocks  # every block freed, none cached
    out, outputs = run_step(s)
    new = {n.req_id: n for n in out.scheduled_new_reqs}
    assert set(new) == {"a", "b", "c"} and out.finished_req_ids == set()
    assert all(n.output_token_ids == [7, 7] and n.num_computed_tokens == 0 for n in new.values())
    assert [o.new_token_ids for o in outputs] == [[7]] * 3  # the lost third token, sampled again


def test_a_request_the_worker_failed_ends_with_an_error_and_the_others_go_on():
    s = make_scheduler()
    s.add_request(make_request("good", 5, max_tokens=3))
    s.add_request(make_request("bad", 5, max_tokens=3))
    out = s.schedule()
    outputs = s.update_from_output(out, ModelRunnerOutput(req_ids=["good"], sampled_token_ids=[7], logprobs=[None],
                                                          failed={"bad": "structured outputs: broken"}))
    by_id = {o.request_id: o for o in outputs}
    assert by_id["good"].new_token_ids == [7] and not by_id["good"].finished
    assert by_id["bad"].finish_reason == FinishReason.ERROR and by_id["bad"].error == "structured outputs: broken"
    assert "bad" not in s.requests and [r.request_id for r in s.running] == ["good"]
    out, _ = run_step(s)
    assert "bad" in out.finished_req_ids and list(out.num_scheduled_tokens) == ["good"]
