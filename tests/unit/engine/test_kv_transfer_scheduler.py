"""Disaggregated prefill / decode in the scheduler (real KV-cache manager, a fake worker): a producer's
prefill-only request ends after one token holding its blocks until pulled, aborted or expired; a
consumer pulls the prompt's KV instead of computing it, or computes it when the pull fails; a model
of several KV cache groups (a sliding window beside full attention) moves every group, the window's
blocks out of the consumer's first window unsent."""

from __future__ import annotations

import time

import pytest

from gridserve.services.engine.kv_cache_manager import KVCacheManager
from gridserve.services.engine.kv_transfers import check_consumer
from gridserve.services.engine.request import Request, RequestStatus
from gridserve.services.engine.scheduler import Scheduler
from gridserve.shared.config import (
    CacheConfig,
    GridserveConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from gridserve.shared.errors import ConfigError, InvalidArgumentError
from gridserve.shared.kv_cache_spec import FULL, SLIDING_WINDOW, KVCacheGroup
from gridserve.shared.kv_transfer import KVTransferParams
from gridserve.shared.outputs import FinishReason
from gridserve.shared.sampling_params import SamplingParams
from gridserve.shared.scheduler_output import ModelRunnerOutput, SchedulerOutput

BLOCK = 16


def _scheduler(role: str, timeout_s: float = 30.0) -> Scheduler:
    config = GridserveConfig(
        model=ModelConfig(model="tiny", max_model_len=512),
        cache=CacheConfig(block_size=BLOCK, kv_role=role, kv_transfer_timeout_s=timeout_s),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256),
        parallel=ParallelConfig(worker_addresses=["10.0.0.1:7000"]),
    )
    return Scheduler(config, KVCacheManager(32, BLOCK, True))


def _tp_scheduler(role: str) -> Scheduler:
    """An engine of two TP workers."""
    config = GridserveConfig(
        model=ModelConfig(model="tiny", max_model_len=512),
        cache=CacheConfig(block_size=BLOCK, kv_role=role),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256),
        parallel=ParallelConfig(tensor_parallel_size=2, worker_addresses=["10.0.0.1:7000", "10.0.0.2:7000"]),
    )
    return Scheduler(config, KVCacheManager(32, BLOCK, True))


def _answer(s: Scheduler, out: SchedulerOutput, token: int = 7, **extra) -> list:
    sampled = [r for r in out.num_scheduled_tokens
               if s.requests.get(r) and s.requests[r].num_computed_tokens >= s.requests[r].num_tokens]
    return s.update_from_output(out, ModelRunnerOutput(req_ids=sampled, sampled_token_ids=[token] * len(sampled),
                                                       logprobs=[None] * len(sampled), **extra))


def test_a_prefill_only_request_ends_after_one_token_and_holds_its_blocks_until_pulled():
    s = _scheduler("kv_producer")
    s.add_request(Request("r", list(range(40)), SamplingParams(max_tokens=20), prefill_only=True))
    outputs = _answer(s, s.schedule())
    (out,) = outputs
    assert out.new_token_ids == [7] and out.finish_reason == FinishReason.LENGTH
    params = out.kv_transfer_params
    assert params.num_tokens == 40 and len(params.block_ids) == 3 and params.worker_addresses == ("10.0.0.1:7000",)
    assert s.kv.num_free_blocks == 31 - 3 and s.kv_transfers_waiting  # held, not freed
    plan = s.schedule()  # the workers hear of the transfer before anything else runs
    assert [k.transfer_id for k in plan.kv_sends] == [params.transfer_id] and plan.kv_sends[0].token == params.token
    s.update_from_output(plan, ModelRunnerOutput(kv_sent=[params.transfer_id], kv_bytes_sent=1234))
    assert s.kv.num_free_blocks == 31 and s.transfers.stats.transfers_sent == 1
    assert s.transfers.stats.bytes_sent == 1234
    assert s.schedule().kv_releases == [params.transfer_id] and not s.kv_transfers_waiting


def test_a_natural_stop_on_the_first_token_holds_nothing():
    s = _scheduler("kv_producer")
    s.add_request(Request("r", list(range(20)), SamplingParams(max_tokens=20), eos_token_id=7, prefill_only=True))
    (out,) = _answer(s, s.schedule(), token=7)
    assert out.finish_reason == FinishReason.STOP and out.kv_transfer_params is None
    assert s.kv.num_free_blocks == 31 and not s.transfers.held


def test_with_two_workers_a_transfer_ends_once_both_ranks_served_their_shard():
    s = _tp_scheduler("kv_producer")
    s.add_request(Request("r", list(range(40)), SamplingParams(max_tokens=20), prefill_only=True))
    (out,) = _answer(s, s.schedule())
    params = out.kv_transfer_params
    assert params.worker_addresses == ("10.0.0.1:7000", "10.0.0.2:7000") and params.tensor_parallel_size == 2
    s.update_from_output(s.schedule(), ModelRunnerOutput(kv_sent=[params.transfer_id], kv_bytes_sent=100))
    assert s.kv.num_free_blocks == 31 - 3 and s.transfers.stats.transfers_sent == 0  # rank 1 not yet
    s.update_from_output(s.schedule(), ModelRunnerOutput(kv_sent=[params.transfer_id], kv_bytes_sent=100))
    assert s.kv.num_free_blocks == 31 and s.transfers.stats.transfers_sent == 1
    assert s.transfers.stats.bytes_sent == 200 and s.schedule().kv_releases == [params.transfer_id]


def test_an_unpulled_transfer_is_freed_at_its_deadline():
    s = _scheduler("kv_producer", timeout_s=0.05)
    s.add_request(Request("r", list(range(40)), SamplingParams(max_tokens=5), prefill_only=True))
    _answer(s, s.schedule())
    assert s.kv.num_free_blocks == 28
    time.sleep(0.1)
    plan = s.schedule()
    assert s.kv.num_free_blocks == 31 and s.transfers.stats.transfers_expired == 1
    assert plan.kv_sends == plan.kv_releases == []  # no plan named it: the workers never hear of it


def test_an_expired_transfer_the_workers_serve_is_released_there():
    s = _scheduler("kv_producer", timeout_s=0.05)
    s.add_request(Request("r", list(range(40)), SamplingParams(max_tokens=5), prefill_only=True))
    (out,) = _answer(s, s.schedule())
    assert [k.transfer_id for k in s.schedule().kv_sends] == [out.kv_transfer_params.transfer_id]
    time.sleep(0.1)
    assert s.schedule().kv_releases == [out.kv_transfer_params.transfer_id]
    assert s.kv.num_free_blocks == 31 and s.transfers.stats.transfers_expired == 1


def _params(num_tokens: int, **changes) -> KVTransferParams:
    fields = dict(transfer_id="t", token="k", worker_addresses=("p:1",), block_ids=tuple(range(-(-num_tokens // BLOCK))),
                  num_tokens=num_tokens, deadline_unix_s=time.time() + 30, block_size=BLOCK, kv_cache_dtype="auto",
                  model="tiny")
    fields.update(changes)
    return KVTransferParams(**fields)


def test_a_consumer_pulls_the_prompt_and_computes_only_the_producer_s_token():
    s = _scheduler("kv_consumer")
    s.add_request(Request("r", list(range(40)), SamplingParams(max_tokens=5), output_token_ids=[7],
                          kv_transfer_params=_params(40)))
    plan = s.schedule()
    (new,) = plan.scheduled_new_reqs
    assert new.kv_load.transfer_id == "t" and new.num_computed_tokens == 40 and plan.num_scheduled_tokens == {"r": 1}
    assert s.kv.block_pool.cached_block_hash_to_block == {}  # not in the prefix cache until the pull is confirmed
    (out,) = _answer(s, plan, token=9)
    assert out.new_token_ids == [9] and s.transfers.stats.transfers_received == 1
    assert s.requests["r"].kv_load is None
    _answer(s, s.schedule())
    assert len(s.kv.block_pool.cached_block_hash_to_block) == 2  # confirmed: the prompt's full blocks are cached


def test_a_failed_pull_falls_back_to_computing_the_prompt_here():
    s = _scheduler("kv_consumer")
    s.add_request(Request("r", list(range(40)), SamplingParams(max_tokens=5), output_token_ids=[7],
                          kv_transfer_params=_params(40)))
    plan = s.schedule()
    outputs = s.update_from_output(plan, ModelRunnerOutput(kv_load_failed={"r": "NOT_FOUND"}))
    assert outputs == [] and s.requests["r"].status == RequestStatus.PREEMPTED
    assert s.kv.num_free_blocks == 31 and s.transfers.stats.transfers_failed == 1
    forget = s.schedule()  # the worker forgets it first
    assert "r" in forget.finished_req_ids and not forget.scheduled_new_reqs
    again = s.schedule()
    (new,) = again.scheduled_new_reqs
    assert new.kv_load is None and new.num_computed_tokens == 0 and again.num_scheduled_tokens == {"r": 41}
    (out,) = _answer(s, again, token=9)
    assert out.new_token_ids == [9] and s.requests["r"].output_token_ids == [7, 9]


@pytest.mark.parametrize("field, change", [("block_size", {"block_size": 32}), ("kv_cache_dtype", {"kv_cache_dtype": "bfloat16"}),
                                           ("model", {"model": "other"}), ("quantization", {"quantization": "int8"}),
                                           ("world_size", {"world_size": 2, "worker_addresses": ("p:1", "p:2")}),
                                           ("tensor_parallel_size", {"tensor_parallel_size": 2}),
                                           ("worker_addresses", {"worker_addresses": ("p:1", "p:2")})])
def test_a_mismatched_producer_is_refused_naming_the_field(field, change):
    config = GridserveConfig(model=ModelConfig(model="tiny"), cache=CacheConfig(block_size=BLOCK, kv_role="kv_consumer"))
    with pytest.raises(ConfigError, match=f"kv_transfer_params.{field}"):
        check_consumer(config, _params(40, **change), 40, 1)
    with pytest.raises(InvalidArgumentError, match="output_token_ids"):
        check_consumer(config, _params(40), 40, 0)
    with pytest.raises(InvalidArgumentError, match="kv_role"):
        check_consumer(GridserveConfig(model=ModelConfig(model="tiny")), _params(40), 40, 1)


def test_aborting_a_held_request_releases_its_blocks_at_once_not_at_the_deadline():
    s = _scheduler("kv_producer")
    s.add_request(Request("r", list(range(40)), SamplingParams(max_tokens=20), prefill_only=True))
    (out,) = _answer(s, s.schedule())
    params = out.kv_transfer_params
    assert s.schedule().kv_sends[0].transfer_id == params.transfer_id  # the workers serve it now
    assert s.abort_requests(["r"]) == []  # finished already: nothing to publish as aborted
    assert s.kv.num_free_blocks == 31 and s.transfers.stats.held_blocks == 0 and not s.transfers.held
    assert s.schedule().kv_releases == [params.transfer_id]  # the workers stop serving it
    assert s.transfers.stats.transfers_expired == s.transfers.stats.transfers_sent == 0
    assert s.transfers.stats.transfers_released == 1
    assert not s.kv_transfers_waiting


def test_a_transfer_released_before_any_plan_named_it_never_reaches_the_workers():
    s = _scheduler("kv_producer")
    s.add_request(Request("r", list(range(40)), SamplingParams(max_tokens=20), prefill_only=True))
    s.add_request(Request("other", list(range(20)), SamplingParams(max_tokens=20), prefill_only=True))
    outputs = _answer(s, s.schedule())
    kept = next(o.kv_transfer_params for o in outputs if o.request_id == "other")
    s.abort_requests(iter(["r", "unknown"]))
    plan = s.schedule()
    assert [k.transfer_id for k in plan.kv_sends] == [kept.transfer_id] and plan.kv_releases == []
    assert s.transfers.stats.held_blocks == 2 and s.kv.num_free_blocks == 29


WINDOW = 32
HYBRID = (KVCacheGroup(SLIDING_WINDOW, ("w",), WINDOW), KVCacheGroup(FULL, ("f",)))  # group 0: the window


def _hybrid_config(role: str) -> GridserveConfig:
    return GridserveConfig(model=ModelConfig(model="tiny", max_model_len=512),
                           cache=CacheConfig(block_size=BLOCK, kv_role=role),
                           scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256),
                           parallel=ParallelConfig(worker_addresses=["10.0.0.1:7000"]))


def _hybrid_scheduler(role: str) -> Scheduler:
    return Scheduler(_hybrid_config(role), KVCacheManager(64, BLOCK, True, HYBRID))


def test_a_hybrid_model_s_prefill_only_request_holds_every_group_s_prompt_blocks_until_pulled():
    """80 prompt tokens: 5 blocks a group; the consumer's first token (position 80) sees positions
    49.. in the window, so the window group's first 3 blocks are not sent (null in the params)."""
    s = _hybrid_scheduler("kv_producer")
    s.add_request(Request("r", list(range(80)), SamplingParams(max_tokens=20), prefill_only=True))
    plan = s.schedule()
    window, full = s.kv.get_block_ids("r")
    (out,) = _answer(s, plan)
    params = out.kv_transfer_params
    assert params.block_ids == (0, 0, 0, *window[3:5]) and params.more_group_block_ids == (tuple(full[:5]),)
    assert s.kv.num_free_blocks == 63 - 10 and s.transfers.stats.held_blocks == 10  # every block held
    check_consumer(_hybrid_config("kv_consumer"), params, 80, 1)  # a consumer of the same model takes them
    plan = s.schedule()
    (send,) = plan.kv_sends
    assert send.group_block_ids == params.group_block_ids
    s.update_from_output(plan, ModelRunnerOutput(kv_sent=[params.transfer_id]))
    assert s.kv.num_free_blocks == 63 and s.kv.blocks_in_use == [0, 0]  # no leak in any group
    assert s.transfers.stats.held_blocks == 0 and s.schedule().kv_releases == [params.transfer_id]


def test_a_hybrid_consumer_pulls_every_group_and_frees_the_window_s_skipped_blocks_after():
    s = _hybrid_scheduler("kv_consumer")
    params = _params(80, block_ids=(0, 0, 0, 9, 10), more_group_block_ids=((1, 2, 3, 4, 5),))
    check_consumer(_hybrid_config("kv_consumer"), params, 80, 1)
    s.add_request(Request("r", list(range(80)), SamplingParams(max_tokens=5), output_token_ids=[7],
                          kv_transfer_params=params))
    plan = s.schedule()
    (new,) = plan.scheduled_new_reqs
    assert new.kv_load.group_block_ids == params.group_block_ids and new.num_computed_tokens == 80
    assert [len(ids) for ids in new.block_ids] == [6, 6] and plan.num_scheduled_tokens == {"r": 1}
    (out,) = _answer(s, plan, token=9)
    assert out.new_token_ids == [9] and s.transfers.stats.transfers_received == 1
    _answer(s, s.schedule())  # position 81 on: the window's first 3 blocks (never written) go back
    assert s.kv.get_block_ids("r")[0][:3] == [0, 0, 0] and s.kv.blocks_in_use == [3, 6]
    bad = _params(80, block_ids=(0, 0, 9, 10), more_group_block_ids=((1, 2, 3, 4, 5),))
    with pytest.raises(InvalidArgumentError, match=r"kv_transfer_params\.block_ids.*group 0"):
        check_consumer(_hybrid_config("kv_consumer"), bad, 80, 1)
    bad = _params(80, more_group_block_ids=((1, 2, 3, 4),))
    with pytest.raises(InvalidArgumentError, match=r"kv_transfer_params\.more_group_block_ids\[0\]"):
        check_consumer(_hybrid_config("kv_consumer"), bad, 80, 1)


def test_params_of_another_group_count_are_computed_here_not_pulled():
    """A producer planned with --disable-hybrid-kv-cache-manager (one group) and a hybrid consumer."""
    s = _hybrid_scheduler("kv_consumer")
    s.add_request(Request("r", list(range(40)), SamplingParams(max_tokens=5), output_token_ids=[7],
                          kv_transfer_params=_params(40)))
    plan = s.schedule()
    (new,) = plan.scheduled_new_reqs
    assert new.kv_load is None and new.num_computed_tokens == 0 and plan.num_scheduled_tokens == {"r": 41}
    assert s.requests["r"].kv_load is None
