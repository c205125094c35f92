"""Priority scheduling on a real model (the offline engine, ``scheduling_policy="priority"``): a
high-priority request that arrives while every slot is taken runs at once and finishes first, and
the requests it preempted end with exactly the greedy tokens they get alone."""

from __future__ import annotations

import pytest

from gridserve import LLM, SamplingParams
from gridserve.services.engine.request import RequestStatus
from gridserve.shared.errors import InvalidArgumentError

PROMPTS = ["def main():", "import sys", "class Queue:", "for i in range(10):"]
LONG = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
SHORT = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(llama_tiny) -> LLM:
    return LLM(model=str(llama_tiny), kv_cache_memory_bytes=32 << 20, max_model_len=256, max_num_seqs=4,
               scheduling_policy="priority")


def test_a_high_priority_request_takes_a_slot_at_once_and_finishes_first(llm):
    alone = {p: out.outputs[0].token_ids for p, out in zip(PROMPTS, llm.generate(PROMPTS, LONG, use_tqdm=False))}
    probe_alone = llm.generate(["import os"], SHORT, use_tqdm=False)[0].outputs[0].token_ids
    engine, scheduler = llm.llm_engine, llm.llm_engine.core.scheduler
    preemptions = scheduler.num_preemptions
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(prompt, LONG, request_id=f"low-{i}", priority=1)
    finished = []
    while len(scheduler.running) < 4 or any(r.num_output_tokens < 4 for r in scheduler.running):
        finished += engine.step()  # saturate: every slot busy, every request decoding
    engine.add_request("import os", SHORT, request_id="high", priority=-1)
    finished += engine.step()
    assert scheduler.requests["high"].status is RequestStatus.RUNNING  # no wait for a free slot
    assert scheduler.num_preemptions == preemptions + 1 and len(scheduler.running) == 4
    while engine.has_unfinished_requests():
        finished += engine.step()
    assert [out.request_id for out in finished][0] == "high"
    by_id = {out.request_id: out.outputs[0].token_ids for out in finished}
    assert by_id["high"] == probe_alone
    assert [by_id[f"low-{i}"] for i in range(4)] == [alone[p] for p in PROMPTS]  # the preempted one too
    kv = llm.llm_engine.core.kv_cache_manager
    assert kv.num_free_blocks == kv.num_total_blocks


def test_generate_takes_one_priority_per_prompt(llm):
    outs = llm.generate(PROMPTS, LONG, use_tqdm=False, priority=[3, 2, 1, 0])
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids
                                                       for o in llm.generate(PROMPTS, LONG, use_tqdm=False)]
    with pytest.raises(InvalidArgumentError, match="priority"):
        llm.generate(PROMPTS, LONG, use_tqdm=False, priority=[0, 1])
    with pytest.raises(InvalidArgumentError, match="priority"):
        llm.generate(PROMPTS, LONG, use_tqdm=False, priority=[0, 1, True, 2])


def test_an_fcfs_engine_refuses_a_priority_before_any_prompt_runs(llama_tiny):
    fcfs = LLM(model=str(llama_tiny), kv_cache_memory_bytes=8 << 20, max_model_len=128)
    try:
        with pytest.raises(InvalidArgumentError, match="priority"):
            fcfs.generate(PROMPTS, SHORT, use_tqdm=False, priority=[0, 0, -1, 0])
        assert not fcfs.llm_engine.has_unfinished_requests()
        assert len(fcfs.generate(PROMPTS, SHORT, use_tqdm=False, priority=[0] * 4)) == 4
    finally:
        fcfs.shutdown()
