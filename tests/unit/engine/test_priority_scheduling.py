"""``--scheduling-policy priority``: the waiting queue and the running batch in (priority, arrival)
order, a better request taking a worse running one's slot or KV blocks, the KV cache's victim the
worst-priority request, no block leaked and no token changed by the churn; FCFS refuses a priority."""

from __future__ import annotations

import random

import pytest

from gridserve.services.engine.core import EngineCore
from gridserve.services.engine.kv_cache_manager import KVCacheManager
from gridserve.services.engine.request import Request, RequestStatus
from gridserve.services.engine.scheduler import Scheduler
from gridserve.services.engine.scheduling_policy import FCFSPolicy, PriorityPolicy, make_policy
from gridserve.shared.config import GridserveConfig, LoRAConfig, ModelConfig, SchedulerConfig
from gridserve.shared.errors import ConfigError, InvalidArgumentError
from gridserve.shared.lora import LoRARequest
from gridserve.shared.sampling_params import SamplingParams
from gridserve.shared.scheduler_output import ModelRunnerOutput
from tests.unit.engine.test_scheduler import EOS, run_step
from tests.unit.engine.test_spec_decode_scheduler import SpecWorker

PRIORITY = "priority"


def make_scheduler(policy=PRIORITY, num_blocks=64, max_num_seqs=8, budget=256, max_model_len=512,
                   caching=True, lora=None) -> Scheduler:
    config = GridserveConfig(
        model=ModelConfig(max_model_len=max_model_len),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                  scheduling_policy=policy),
        **({"lora": lora} if lora is not None else {}),
    )
    return Scheduler(config, KVCacheManager(num_blocks, 16, caching))


_arrival = iter(range(1, 1_000_000))


def make_request(rid, n_prompt=10, priority=0, max_tokens=8) -> Request:
    """A request with a fresh prompt (no prefix hits between requests) and a strictly later arrival."""
    n = next(_arrival)
    start = 100 * n
    return Request(rid, list(range(start, start + n_prompt)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   eos_token_id=EOS, arrival_time=float(n), priority=priority)


def ids(requests) -> list[str]:
    return [r.request_id for r in requests]


# ---- the policy and its settings ----------------------------------------------------------------
def test_fcfs_refuses_a_nonzero_priority_naming_it():
    s = make_scheduler("fcfs")
    with pytest.raises(InvalidArgumentError) as refused:
        s.add_request(make_request("a", priority=-1))
    assert refused.value.field == "priority" and "fcfs" in refused.value.message
    assert "a" not in s.requests and not s.waiting
    s.add_request(make_request("b", priority=0))  # 0 is every policy's default
    assert ids(s.waiting) == ["b"]


def test_an_unknown_policy_is_a_config_error_naming_the_field():
    with pytest.raises(ConfigError, match="scheduler.scheduling_policy"):
        SchedulerConfig(scheduling_policy="lifo")
    assert isinstance(make_policy("fcfs"), FCFSPolicy) and isinstance(make_policy(PRIORITY), PriorityPolicy)


# ---- order ---------------------------------------------------------------------------------------
def test_waiting_requests_are_admitted_by_priority_then_arrival():
    s = make_scheduler(budget=20)  # two 10-token prompts per step
    for rid, priority in (("a", 0), ("b", 5), ("c", -1), ("d", 0)):
        s.add_request(make_request(rid, priority=priority))
    assert ids(s.waiting) == ["c", "a", "d", "b"]
    out, _ = run_step(s)
    assert [r.req_id for r in out.scheduled_new_reqs] == ["c", "a"]
    assert ids(s.running) == ["c", "a"] and ids(s.waiting) == ["d", "b"]


def test_a_continuation_goes_ahead_of_new_requests_of_its_priority_only():
    s = make_scheduler()
    s.add_request(make_request("new-0", priority=0))
    s.add_request(make_request("high", priority=-1))
    cont = make_request("cont-0", priority=0)
    cont.admit_always = True
    s.add_request(cont)
    assert ids(s.waiting) == ["high", "cont-0", "new-0"]


# ---- a slot at max_num_seqs ----------------------------------------------------------------------
def test_a_better_request_takes_the_slot_of_the_worst_running_one_at_once():
    s = make_scheduler(max_num_seqs=3)
    for rid, priority in (("a", 0), ("b", 2), ("c", 1)):
        s.add_request(make_request(rid, priority=priority, max_tokens=50))
    run_step(s)
    assert ids(s.running) == ["a", "c", "b"]  # kept in priority order: the last is the worst
    s.add_request(make_request("probe", priority=-1, max_tokens=4))
    out, _ = run_step(s)
    assert [r.req_id for r in out.scheduled_new_reqs] == ["probe"]
    assert "b" in out.finished_req_ids and "b" not in out.num_scheduled_tokens  # the worst one
    assert not any(c.req_id == "b" for c in out.scheduled_cached_reqs)
    assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
    b = s.requests["b"]
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and ids(s.waiting) == ["b"]
    assert ids(s.running) == ["probe", "a", "c"] and s.num_preemptions == 1


def test_an_equal_or_worse_request_waits_for_a_free_slot():
    s = make_scheduler(max_num_seqs=2)
    for rid in ("a", "b"):
        s.add_request(make_request(rid, priority=1, max_tokens=3))
    run_step(s)
    s.add_request(make_request("same", priority=1))  # arrived later: worse than both
    s.add_request(make_request("worse", priority=7))
    out, _ = run_step(s)
    assert not out.scheduled_new_reqs and not out.finished_req_ids and s.num_preemptions == 0
    while "a" in s.requests:
        run_step(s)
    out, _ = run_step(s)
    assert [r.req_id for r in out.scheduled_new_reqs] == ["same", "worse"] and s.num_preemptions == 0


def test_a_preempted_request_never_preempts_back_the_one_that_took_its_place():
    s = make_scheduler(max_num_seqs=1)
    s.add_request(make_request("low", priority=3, max_tokens=20))
    run_step(s)
    s.add_request(make_request("high", priority=0, max_tokens=6))
    out, _ = run_step(s)
    assert "low" in out.finished_req_ids and [r.req_id for r in out.scheduled_new_reqs] == ["high"]
    scheduled = []
    while s.has_unfinished_requests():
        out, _ = run_step(s)
        scheduled.append(set(out.num_scheduled_tokens))
    # "high" runs to its end alone, then "low" resumes: one preemption, no ping-pong
    assert s.num_preemptions == 1
    assert scheduled.index({"low"}) > max(i for i, step in enumerate(scheduled) if "high" in step)


def test_fcfs_never_preempts_for_a_waiting_request():
    s = make_scheduler("fcfs", max_num_seqs=2)
    for rid in ("a", "b", "c"):
        s.add_request(make_request(rid, max_tokens=4))
    out, _ = run_step(s)
    assert [r.req_id for r in out.scheduled_new_reqs] == ["a", "b"]
    while "c" not in {r.req_id for r in out.scheduled_new_reqs}:
        out, _ = run_step(s)
    assert s.num_preemptions == 0 and "a" not in s.requests  # "c" got a slot once "a" had finished


# ---- KV blocks -----------------------------------------------------------------------------------
def test_kv_exhaustion_preempts_the_worst_priority_request_not_the_newest():
    s = make_scheduler(num_blocks=5, max_model_len=64)  # 4 usable blocks = 64 tokens
    s.add_request(make_request("low", n_prompt=30, priority=5, max_tokens=30))
    run_step(s)
    s.add_request(make_request("high", n_prompt=30, priority=0, max_tokens=30))  # the newest
    for _ in range(40):
        out, _ = run_step(s)
        if out.finished_req_ids:
            break
    assert out.finished_req_ids == {"low"} and s.requests["low"].status is RequestStatus.PREEMPTED
    assert s.requests["high"].status is RequestStatus.RUNNING


def test_fcfs_kv_exhaustion_still_preempts_the_newest():
    s = make_scheduler("fcfs", num_blocks=5, max_model_len=64)
    s.add_request(make_request("old", n_prompt=30, max_tokens=30))
    run_step(s)
    s.add_request(make_request("new", n_prompt=30, max_tokens=30))
    for _ in range(40):
        out, _ = run_step(s)
        if out.finished_req_ids:
            break
    assert out.finished_req_ids == {"new"}


def test_a_better_request_short_of_kv_blocks_preempts_a_worse_running_one():
    s = make_scheduler(num_blocks=6)  # 5 usable blocks
    s.add_request(make_request("low", n_prompt=60, priority=1, max_tokens=10))  # 4 blocks
    run_step(s)
    s.add_request(make_request("high", n_prompt=40, priority=0, max_tokens=4))  # needs 3
    out, _ = run_step(s)
    assert "low" in out.finished_req_ids and [r.req_id for r in out.scheduled_new_reqs] == ["high"]
    assert "low" not in out.num_scheduled_tokens
    while s.has_unfinished_requests():
        run_step(s)
    assert s.kv.num_free_blocks == s.kv.num_total_blocks


# ---- what a preemption for a slot must not break -------------------------------------------------
def test_a_request_preempted_while_its_sample_is_in_flight_keeps_that_sample():
    s = make_scheduler(max_num_seqs=2)
    for rid in ("a", "b"):
        s.add_request(make_request(rid, priority=1, max_tokens=6))
    first = s.schedule()  # prefills; samples in flight
    s.add_request(make_request("probe", priority=0, max_tokens=2))
    second = s.schedule()  # "b" loses its slot while its first sample is still on the way
    assert "b" in second.finished_req_ids and "probe" in second.num_scheduled_tokens
    sample = ModelRunnerOutput(req_ids=list(first.num_scheduled_tokens), sampled_token_ids=[7, 7],
                               logprobs=[None, None])
    s.update_from_output(first, sample)
    b = s.requests["b"]
    assert b.output_token_ids == [7] and b.num_output_placeholders == 0 and b.status is RequestStatus.PREEMPTED
    s.update_from_output(second, ModelRunnerOutput(req_ids=["a", "probe"], sampled_token_ids=[8, 9],
                                                   logprobs=[None, None]))
    while s.has_unfinished_requests():
        out, _ = run_step(s)
        resumed = [r for r in out.scheduled_new_reqs if r.req_id == "b"]
        if resumed:
            assert resumed[0].output_token_ids == [7]
    assert s.kv.num_free_blocks == s.kv.num_total_blocks


def test_a_lora_request_passed_over_at_max_loras_preempts_nothing():
    a, b = LoRARequest("a", 1, "/adapters/a"), LoRARequest("b", 2, "/adapters/b")
    s = make_scheduler(max_num_seqs=2, lora=LoRAConfig(enable_lora=True, max_loras=1))
    for rid in ("a1", "a2"):
        on_a = make_request(rid, priority=1, max_tokens=20)
        on_a.lora_request = a
        s.add_request(on_a)
    run_step(s)
    on_b = make_request("b1", priority=0)
    on_b.lora_request = b
    s.add_request(on_b)
    out, _ = run_step(s)
    assert not out.scheduled_new_reqs and s.num_preemptions == 0 and ids(s.waiting) == ["b1"]


def test_preemption_for_a_slot_takes_back_the_victims_drafts():
    spec = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 8}
    config = GridserveConfig(model=ModelConfig(max_model_len=256, num_layers=1, num_kv_heads=1, head_dim=8,
                                               vocab_size=2000),
                             scheduler=SchedulerConfig(speculative_config=spec, max_num_seqs=2,
                                                       scheduling_policy=PRIORITY))
    core = EngineCore(config, SpecWorker(config))
    for rid, priority in (("a", 0), ("b", 1)):
        core.add_request(Request(rid, [5, 6, 7, 8, 9], SamplingParams(max_tokens=20, ignore_eos=True),
                                 eos_token_id=EOS, priority=priority))
    for _ in range(4):
        core.step()
    assert core.scheduler.requests["b"].spec_token_ids  # it would verify drafts this step
    core.add_request(Request("probe", [11, 12, 13], SamplingParams(max_tokens=3, ignore_eos=True),
                             eos_token_id=EOS, priority=-1))
    plan = core.scheduler.schedule()
    assert "b" in plan.finished_req_ids and "b" not in plan.scheduled_spec_tokens
    assert "b" not in plan.num_scheduled_tokens and "probe" in plan.num_scheduled_tokens


# ---- churn: no leak, no changed token ------------------------------------------------------------
class SmallCacheWorker(SpecWorker):
    """The fake worker (tokens a function of the sequence) with room for 12 KV blocks of 16 tokens."""

    def determine_available_memory(self) -> int:
        return 12 * 16 * 64


def _engine(max_num_seqs: int) -> EngineCore:
    config = GridserveConfig(model=ModelConfig(max_model_len=128, num_layers=1, num_kv_heads=1, head_dim=8,
                                               vocab_size=2000),
                             scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=64,
                                                       scheduling_policy=PRIORITY))
    return EngineCore(config, SmallCacheWorker(config))


def _drive(core: EngineCore, arrivals: dict[int, list[Request]]) -> dict[str, list[int]]:
    """Step the engine, adding each step's arrivals first; every request's tokens."""
    tokens: dict[str, list[int]] = {}
    for step in range(5000):
        for request in arrivals.pop(step, []):
            core.add_request(request)
            tokens[request.request_id] = []
        if not arrivals and not core.has_unfinished_requests():
            break
        for out in core.step():
            tokens[out.request_id] += out.new_token_ids
    return tokens


def test_preemption_churn_leaks_no_block_and_changes_no_token():
    rng = random.Random(40)
    prompts = {f"r{i}": [rng.randrange(3, 1900) for _ in range(rng.randrange(5, 60))] for i in range(40)}
    lengths = {rid: rng.randrange(3, 40) for rid in prompts}

    def request(rid: str, priority: int) -> Request:
        return Request(rid, prompts[rid], SamplingParams(max_tokens=lengths[rid], ignore_eos=True),
                       eos_token_id=EOS, priority=priority)

    alone = {}
    for rid in prompts:  # each request by itself: the reference tokens
        alone |= _drive(_engine(4), {0: [request(rid, 0)]})
    core = _engine(max_num_seqs=4)
    kv = core.kv_cache_manager
    free_at_start = kv.num_free_blocks
    arrivals: dict[int, list[Request]] = {}
    for i, rid in enumerate(prompts):
        arrivals.setdefault(i // 2, []).append(request(rid, rng.randrange(-3, 4)))
    churned = _drive(core, arrivals)
    assert core.scheduler.num_preemptions > 10  # slots and blocks changed hands many times
    assert churned == alone and all(len(t) == lengths[rid] for rid, t in churned.items())
    assert kv.num_free_blocks == free_at_start == kv.num_total_blocks
    assert not core.scheduler.requests and not core.scheduler.running and not core.scheduler.waiting
