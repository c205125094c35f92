"""``--max-waiting-requests`` is finite by default: max(1024, 4 x ``--max-num-seqs``) waiting requests,
so a flood is refused (RESOURCE_EXHAUSTED / 429) instead of queueing without end, while workload W
(256 requests at once, prompts of 64-256 tokens, outputs of 32-256) is admitted whole, even by an
engine whose KV cache runs only a few of them at a time."""

from __future__ import annotations

import random

import pytest

from gridserve.roles import ENGINE_OPTIONS
from gridserve.services.engine.kv_cache_manager import KVCacheManager
from gridserve.services.engine.request import Request
from gridserve.services.engine.scheduler import Scheduler
from gridserve.shared.config import GridserveConfig, ModelConfig, SchedulerConfig
from gridserve.shared.errors import ResourceExhaustedError
from gridserve.shared.sampling_params import SamplingParams


def _scheduler(scheduler: SchedulerConfig, num_blocks: int = 64) -> Scheduler:
    config = GridserveConfig(model=ModelConfig(max_model_len=512), scheduler=scheduler)
    return Scheduler(config, KVCacheManager(num_blocks, 16, True))


def _workload_w(seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    return [Request(f"w{i}", [rng.randrange(3, 1000) for _ in range(rng.randint(64, 256))],
                    SamplingParams(max_tokens=rng.randint(32, 256), ignore_eos=True), eos_token_id=2)
            for i in range(256)]


@pytest.mark.parametrize("max_num_seqs, expected", [(256, 1024), (1, 1024), (512, 2048)])
def test_the_default_waiting_limit_is_finite(max_num_seqs, expected):
    assert SchedulerConfig(max_num_seqs=max_num_seqs).waiting_limit == expected
    assert _scheduler(SchedulerConfig(max_num_seqs=max_num_seqs)).max_waiting_requests == expected
    assert SchedulerConfig(max_num_seqs=max_num_seqs, max_waiting_requests=7).waiting_limit == 7  # the flag wins


def test_workload_w_is_admitted_whole_by_default_and_a_flood_beyond_the_limit_is_refused():
    s = _scheduler(SchedulerConfig())  # a 1,008-token KV cache: a few of W's requests run at a time
    for request in _workload_w():
        s.add_request(request)  # none refused
    assert len(s.waiting) == 256
    for i in range(1024 - 256):
        s.add_request(Request(f"flood{i}", [5, 6, 7], SamplingParams(max_tokens=4), eos_token_id=2))
    with pytest.raises(ResourceExhaustedError, match="max-waiting-requests 1024"):
        s.add_request(Request("one-too-many", [5, 6, 7], SamplingParams(max_tokens=4), eos_token_id=2))


def test_the_flag_documents_its_default():
    (option,) = [o for o in ENGINE_OPTIONS if o.flag == "--max-waiting-requests"]
    assert "1024" in option.help and "max-num-seqs" in option.help and "unbounded" not in option.help
