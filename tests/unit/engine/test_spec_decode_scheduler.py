"""The engine's side of speculative decoding with a fake worker: drafts scheduled within the
limits, runs of accepted tokens appended one by one (a stop ends them), ``num_computed_tokens``
rolled back and the rejected drafts' blocks given back, no drafts at or above
``disable_by_batch_size``, the counters; outputs equal decoding without speculation."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Optional

import pytest

from gridserve.services.engine.core import EngineCore
from gridserve.services.engine.executor import Executor
from gridserve.services.engine.request import Request
from gridserve.shared.config import GridserveConfig, ModelConfig, SchedulerConfig
from gridserve.shared.errors import ConfigError
from gridserve.shared.kv_cache_spec import FULL, LayerKVCacheSpec
from gridserve.shared.sampling_params import SamplingParams
from gridserve.shared.scheduler_output import ModelRunnerOutput, SchedulerOutput

EOS = 2


def target(tokens: list[int]) -> int:
    """The fake model's greedy next token: a function of the sequence (never EOS by itself)."""
    return (sum(tokens) * 31 + len(tokens)) % 997 + 3


class SpecWorker(Executor):
    """One fake worker that verifies drafts like the real one and proposes the true next tokens
    with every ``wrong_every``-th draft position wrong (partial acceptance)."""

    def __init__(self, config: GridserveConfig, wrong_at: int = 2) -> None:
        self.wrong_at = wrong_at
        self.plans: list[SchedulerOutput] = []
        super().__init__(config)

    def _init_executor(self) -> None:
        self.tokens: dict[str, list[int]] = {}

    def collective_rpc(self, method: str, timeout: Optional[float] = None, args: tuple = (),
                       kwargs: Optional[dict[str, Any]] = None, non_block: bool = False):
        result = {"determine_available_memory": 64 * 16 * 64,
                  "get_kv_cache_spec": [LayerKVCacheSpec("layer", FULL, 16, 64)]}.get(method)
        if method == "execute_model":
            result = self._step(args[0])
        future: Future = Future()
        future.set_result([result])
        return future if non_block else future.result()

    def _step(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.plans.append(sched)
        for rid in sched.finished_req_ids:
            self.tokens.pop(rid, None)
        for new in sched.scheduled_new_reqs:
            self.tokens[new.req_id] = [*new.prompt_token_ids, *new.output_token_ids]
        computed = {n.req_id: n.num_computed_tokens for n in sched.scheduled_new_reqs}
        computed.update({c.req_id: c.num_computed_tokens for c in sched.scheduled_cached_reqs})
        out = ModelRunnerOutput()
        for rid, n in sched.num_scheduled_tokens.items():
            tokens = self.tokens[rid]
            drafts = sched.scheduled_spec_tokens.get(rid, [])
            if computed[rid] + n - len(drafts) < len(tokens):
                continue  # a prefill chunk that samples nothing
            run = []
            for j in range(len(drafts) + 1):
                sample = target(tokens + drafts[:j])
                run.append(sample)
                if j == len(drafts) or sample != drafts[j]:
                    break
            tokens.extend(run)
            out.req_ids.append(rid)
            out.sampled_token_ids.append(run[0])
            out.logprobs.append(None)
            if len(run) > 1:
                out.extra_token_ids[rid] = run[1:]
            proposal, ahead = [], list(tokens)
            for j in range(3):
                ahead.append(target(ahead))
                proposal.append(ahead[-1] if j != self.wrong_at else 1)
            out.draft_token_ids[rid] = proposal
        return out

    def shutdown(self) -> None:
        pass


def _config(spec: Optional[dict] = None, **scheduler: Any) -> GridserveConfig:
    return GridserveConfig(model=ModelConfig(max_model_len=256, num_layers=1, num_kv_heads=1, head_dim=8,
                                             vocab_size=2000),
                           scheduler=SchedulerConfig(speculative_config=spec or {}, **scheduler))


def _run(core: EngineCore, prompts: list[list[int]], params: SamplingParams) -> dict[str, list[int]]:
    for i, prompt in enumerate(prompts):
        core.add_request(Request(str(i), prompt, params, eos_token_id=EOS))
    outputs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    for _ in range(2000):
        if not core.has_unfinished_requests():
            break
        for out in core.step():
            outputs[out.request_id] += out.new_token_ids
    return outputs


SPEC = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 4}
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13], [20] * 17]


def test_speculation_gives_the_same_tokens_and_accepts_the_right_drafts():
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    plain = _run(EngineCore(_config(), SpecWorker(_config())), PROMPTS, params)
    worker = SpecWorker(_config(SPEC))
    core = EngineCore(_config(SPEC), worker)
    spec = _run(core, PROMPTS, params)
    assert spec == plain and all(len(v) == 30 for v in spec.values())
    stats = core.stats()
    # two right drafts then a wrong one: each verification accepts 2 of 3 (the last step's fewer)
    assert stats.spec_num_drafts > 0 and stats.spec_num_draft_tokens <= 3 * stats.spec_num_drafts
    assert stats.spec_accepted_per_pos[2] == 0 and stats.spec_accepted_per_pos[0] == stats.spec_num_drafts
    assert stats.spec_num_accepted_tokens == sum(stats.spec_accepted_per_pos)
    kv = core.kv_cache_manager
    assert kv.num_free_blocks == kv.num_total_blocks


def test_drafts_never_reach_past_max_tokens_or_max_model_len():
    worker = SpecWorker(_config(SPEC), wrong_at=99)  # every draft right
    core = EngineCore(_config(SPEC), worker)
    out = _run(core, [[5, 6, 7]], SamplingParams(max_tokens=7, ignore_eos=True))
    assert len(out["0"]) == 7
    for plan in worker.plans:
        assert all(len(drafts) <= 3 for drafts in plan.scheduled_spec_tokens.values())
    # the last verification could only take what max_tokens left
    assert core.stats().spec_num_accepted_tokens <= 7 - 1


def test_a_stop_inside_an_accepted_run_ends_the_request_there():
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = _run(EngineCore(_config(), SpecWorker(_config())), [[5, 6, 7, 8, 9]], params)["0"]
    stop = plain[9]  # a token the run will reach inside a verification
    stopped = SamplingParams(max_tokens=40, ignore_eos=True, stop_token_ids=[stop])
    expected = plain[:plain.index(stop) + 1]
    core = EngineCore(_config(SPEC), SpecWorker(_config(SPEC), wrong_at=99))
    assert _run(core, [[5, 6, 7, 8, 9]], stopped)["0"] == expected
    assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.num_total_blocks


def test_no_drafts_at_or_above_the_batch_size_that_turns_speculation_off():
    worker = SpecWorker(_config(SPEC))
    core = EngineCore(_config(SPEC), worker)
    prompts = [[i + 3, i + 4, i + 5] for i in range(6)]
    _run(core, prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    for plan in worker.plans:
        running = len(plan.num_scheduled_tokens)
        if plan.scheduled_spec_tokens:
            assert running < SPEC["disable_by_batch_size"]


@pytest.mark.parametrize(("spec", "field"), [
    ({"method": "eagle"}, "speculative_config.method"),
    ({"method": "draft_model"}, "speculative_config.model"),
    ({"method": "ngram", "model": "/models/draft"}, "speculative_config.model"),
    ({"num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"num_speculative_tokens": 17}, "speculative_config.num_speculative_tokens"),
    ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "speculative_config.prompt_lookup_max"),
    ({"lookahead": 2}, "speculative_config.lookahead"),
    ("{not json", "speculative_config"),
])
def test_a_bad_speculative_config_is_refused_naming_the_field(spec, field):
    with pytest.raises(ConfigError) as info:
        SchedulerConfig(speculative_config=spec)
    assert info.value.field == field


def test_a_draft_model_gets_lookahead_slots_past_each_step_and_gives_them_back():
    """With a draft model every allocation reserves k slots past the step's tokens (the draft
    writes its proposals' K / V there), trimmed with the rejected drafts; outputs unchanged."""
    draft = {"model": "/models/draft", "num_speculative_tokens": 3, "disable_by_batch_size": 4}
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    prompt = list(range(3, 17))  # 14 tokens: one block alone, two with 3 slots of lookahead
    plain = _run(EngineCore(_config(), SpecWorker(_config())), [prompt], params)
    core = EngineCore(_config(draft), SpecWorker(_config(draft)))
    core.add_request(Request("0", prompt, params, eos_token_id=EOS))
    first = core.step() or core.step()
    assert len(core.kv_cache_manager.get_block_ids("0")[0]) == 2
    outputs = [t for out in first for t in out.new_token_ids]
    while core.has_unfinished_requests():
        outputs += [t for out in core.step() for t in out.new_token_ids]
    assert outputs == plain["0"]
    assert core.stats().spec_num_accepted_tokens > 0
    kv = core.kv_cache_manager
    assert kv.num_free_blocks == kv.num_total_blocks
