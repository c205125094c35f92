"""Tensor / pipeline parallel arithmetic (no torch): shard ranges, rank layout, KV sizing, refusals,
the pipelined scheduler and the engine's batch queue."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from gridserve.services.engine.core import EngineCore
from gridserve.services.engine.executor import Executor
from gridserve.services.engine.kv_cache_manager import KVCacheManager
from gridserve.services.engine.request import Request
from gridserve.services.engine.scheduler import Scheduler
from gridserve.shared.config import GridserveConfig, ModelConfig, ParallelConfig, SchedulerConfig
from gridserve.shared.errors import ConfigError
from gridserve.shared.kv_cache_spec import FULL, LayerKVCacheSpec
from gridserve.shared.parallel import (
    RankLayout,
    Shard,
    check_model_shardable,
    even_shard,
    kv_head_shard,
    output_rank,
    pp_group_ranks,
    stage_layers,
    tp_group_ranks,
    vocab_shard,
)
from gridserve.shared.sampling_params import SamplingParams
from gridserve.shared.scheduler_output import ModelRunnerOutput


def test_even_shards_tile_the_dimension_without_overlap():
    shards = [even_shard(12, 4, r) for r in range(4)]
    assert [(s.start, s.size) for s in shards] == [(0, 3), (3, 3), (6, 3), (9, 3)]
    with pytest.raises(ConfigError) as err:
        even_shard(10, 4, 0, "num_attention_heads")
    assert err.value.field == "parallel.tensor_parallel_size" and "num_attention_heads (10)" in err.value.message


def test_vocab_shards_pad_the_last_rank_and_cover_every_token():
    shards = [vocab_shard(4099, 2, r) for r in range(2)]
    assert shards == [Shard(0, 2050, 4099), Shard(2050, 2049, 4099)]
    assert vocab_shard(4096, 1, 0) == Shard(0, 4096, 4096)


def test_kv_heads_split_when_enough_and_replicate_when_fewer_than_ranks():
    assert [kv_head_shard(4, 2, r) for r in range(2)] == [Shard(0, 2, 4), Shard(2, 2, 4)]
    # 2 KV heads over 4 ranks: ranks 0,1 share head 0 and ranks 2,3 share head 1 (their query heads' group)
    assert [kv_head_shard(2, 4, r).start for r in range(4)] == [0, 0, 1, 1]
    assert all(kv_head_shard(2, 4, r).size == 1 for r in range(4))
    with pytest.raises(ConfigError):
        kv_head_shard(3, 4, 0)


def test_stage_layers_split_evenly_with_the_remainder_on_the_first_stages():
    assert [(s.start, s.size) for s in (stage_layers(7, 3, r) for r in range(3))] == [(0, 3), (3, 2), (5, 2)]
    with pytest.raises(ConfigError) as err:
        stage_layers(2, 3, 0)
    assert err.value.field == "parallel.pipeline_parallel_size"


def test_rank_layout_is_pipeline_major_and_the_output_rank_is_tp0_of_the_last_stage():
    assert tp_group_ranks(2, 2) == [[0, 1], [2, 3]]
    assert pp_group_ranks(2, 2) == [[0, 2], [1, 3]]
    assert output_rank(2, 2) == 2 and output_rank(2, 1) == 0 and output_rank(1, 3) == 2
    layout = RankLayout(rank=3, tp_size=2, pp_size=2)
    assert (layout.tp_rank, layout.pp_rank, layout.is_last_stage, layout.is_output_rank) == (1, 1, True, False)
    assert layout.tp_group_ranks() == [2, 3] and layout.pp_group_ranks() == [1, 3]


def _config(tp: int = 1, pp: int = 1, layers: int = 4, heads: int = 8, kv_heads: int = 2) -> GridserveConfig:
    config = GridserveConfig(parallel=ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp))
    config.model = ModelConfig(max_model_len=128)
    config.model.num_layers, config.model.num_kv_heads, config.model.head_dim = layers, kv_heads, 16
    return config


def test_kv_bytes_per_rank_count_only_the_stages_layers_and_the_ranks_heads():
    full = _config().kv_bytes_per_token_per_rank()
    assert full == 2 * 4 * 2 * 16 * 4
    assert _config(tp=2).kv_bytes_per_token_per_rank() == full // 2
    assert _config(pp=2).kv_bytes_per_token_per_rank() == full // 2
    assert _config(tp=4).kv_bytes_per_token_per_rank() == full // 2  # KV heads replicated past 2 ranks
    assert _config(pp=3, layers=4).kv_bytes_per_token_per_rank() == full // 2  # stage 0 holds 2 of 4 layers


def test_unshardable_models_and_architectures_are_refused_naming_the_field():
    with pytest.raises(ConfigError) as err:
        check_model_shardable({"num_attention_heads": 6, "num_hidden_layers": 2}, 4, 1)
    assert "num_attention_heads (6)" in err.value.message
    with pytest.raises(ConfigError) as err:
        ParallelConfig(pipeline_parallel_size=2).check_model("OPTForCausalLM", {"num_hidden_layers": 2})
    assert err.value.field == "parallel.pipeline_parallel_size"
    ParallelConfig().check_model("OPTForCausalLM", {})  # one worker: anything goes


# ---- pipelined scheduling ------------------------------------------------------------------------
def _pipelined_scheduler() -> Scheduler:
    config = GridserveConfig(model=ModelConfig(max_model_len=512),
                             scheduler=SchedulerConfig(max_num_batched_tokens=64),
                             parallel=ParallelConfig(pipeline_parallel_size=2))
    return Scheduler(config, KVCacheManager(64, 16, True))


def _sampled(out, token):
    rids = list(out.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=rids, sampled_token_ids=[token] * len(rids), logprobs=[None] * len(rids))


def test_pipelined_request_waits_for_its_sample_then_sends_it_to_every_stage():
    s = _pipelined_scheduler()
    s.add_request(Request("a", [1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True)))
    first = s.schedule()
    s.add_request(Request("b", [4, 5], SamplingParams(max_tokens=5, ignore_eos=True)))
    second = s.schedule()  # "a" is still in the pipeline: only "b" runs
    assert list(second.num_scheduled_tokens) == ["b"]
    s.update_from_output(first, _sampled(first, 70))
    third = s.schedule()
    assert list(third.num_scheduled_tokens) == ["a"]
    assert third.scheduled_cached_reqs[0].new_token_ids == [70]  # the first stage never sampled it
    s.update_from_output(second, _sampled(second, 80))
    s.update_from_output(third, _sampled(third, 71))
    fourth = s.schedule()
    assert {r.req_id: r.new_token_ids for r in fourth.scheduled_cached_reqs} == {"b": [80], "a": [71]}


class _FakeExecutor(Executor):
    """Records submissions; the test completes their futures."""

    def _init_executor(self) -> None:
        self.futures: list[Future] = []

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None, non_block=False):
        if method == "get_kv_cache_spec":
            return [[LayerKVCacheSpec("layer", FULL, 16, self.config.kv_bytes_per_token_per_rank())]]
        return [1 << 30] if method == "determine_available_memory" else [None]

    def execute_model(self, scheduler_output, non_block=False):
        future: Future = Future()
        self.futures.append((scheduler_output, future))
        return future

    def shutdown(self) -> None:
        pass


def test_engine_keeps_one_batch_per_pipeline_stage_in_flight():
    config = _config(pp=2)
    config.scheduler.max_num_batched_tokens = 64
    executor = _FakeExecutor(config)
    core = EngineCore(config, executor)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    core.add_request(Request("a", [1, 2, 3], params))
    core.add_request(Request("b", [1, 2, 3], params))
    assert core.step() == []
    core.add_request(Request("c", [4, 5, 6], params))
    assert core.step() == []  # a second batch enters the pipeline before the first returns
    assert [list(out.num_scheduled_tokens) for out, _ in executor.futures] == [["a", "b"], ["c"]]
    for out, future in executor.futures:
        future.set_result(_sampled(out, 9))
    assert sorted(o.request_id for o in core.step()) == ["a", "b"]  # nothing new to run: take the oldest
    assert [o.request_id for o in core.step()] == ["c"]
    forget, future = executor.futures[-1]  # an empty plan still tells the workers to drop a and b
    assert forget.is_empty and forget.finished_req_ids == {"a", "b"}
    future.set_result(ModelRunnerOutput())
    assert core.step() == [] and not core.has_unfinished_requests()
