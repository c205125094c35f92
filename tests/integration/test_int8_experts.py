"""``--quantization int8`` on the MoE models quantizes their routed experts (``FusedMoE.quantize``)
along with the dense layers, through the real engine (``LLM``, in-process worker), on the tiny
random checkpoints the zoo tests build (Qwen3-MoE, Mixtral, Qwen2-MoE, DeepSeek-V2, gpt-oss).

Compared with fp32 on the same weights, as the dense int8 tests compare (random weights: bounds that
hold for any weights). The experts alone in int8 (every other layer ignored): teacher-forced over a
96-token prompt, the mean KL stays under the int8 bar (0.02) and the next-token argmax is fp32's
wherever fp32's top-2 gap is clear (> 0.5 nats). The whole model in int8 (``--quantization int8``:
dense layers too, whose rounding dominates on these random weights): the mean KL under the dense
tests' random-weight bound (0.1). Free-running greedy with int8 experts (8 prompts x 16 tokens): at
the first position where a prompt's tokens differ each side's token is in the other's top 5 (the TP
int8 test's rule; with the dense layers in int8 too these random weights part at wider gaps, as the
dense int8 path's own rounding does). Every MoE layer's experts are int8, at about a quarter of
their fp32 bytes.
"""

from __future__ import annotations

import functools

import pytest
import torch

from gridserve import LLM, SamplingParams
from gridserve.benchmarks import quantization as bench
from gridserve.demo.recipe import ensure_checkpoint
from gridserve.services.worker.fused_moe import FusedMoE, expert_parameter_bytes

from . import test_zoo_deepseek, test_zoo_gpt_oss, test_zoo_moe
from .test_llm_matches_hf import _prompts

KV_BYTES = 32 << 20
CLEAR_GAP = 0.5  # nats between fp32's best and second-best token
CHECKPOINTS = {"qwen3_moe": lambda: test_zoo_moe.checkpoint("qwen3_moe"),
               "mixtral": lambda: str(ensure_checkpoint("mixtral", "tiny")),
               "qwen2_moe": lambda: test_zoo_moe.checkpoint("qwen2_moe"),
               "deepseek_v2": lambda: test_zoo_deepseek.checkpoint("deepseek_v2"),
               "gpt_oss": test_zoo_gpt_oss.checkpoint}
TEXT = _prompts(1, 96, 96, seed=21)[0]
PROMPTS = _prompts(8, 3, 40, seed=7)


# the experts alone: every layer but a MoE layer's experts (``...mlp.experts``) ignored
EXPERTS_ONLY = {"method": "int8", "ignore": [r"re:^(?!.*\.experts$).*"]}
MODES = {"fp32": {}, "int8": {"quantization": "int8"}, "int8-experts": {"quantization_config": EXPERTS_ONLY}}


@functools.cache
def _run(name: str, mode: str) -> dict:
    """One engine's teacher-forced logprobs, greedy outputs (with top-5 logprobs), expert bytes and
    the experts' quantization per MoE layer."""
    llm = LLM(model=CHECKPOINTS[name](), kv_cache_memory_bytes=KV_BYTES, **MODES[mode])
    try:
        model = bench._model_of(llm)
        params = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16, logprobs=5)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        return {"logprobs": bench.teacher_forced_logprobs(llm, TEXT),
                "greedy": [o.outputs[0] for o in outputs],
                "expert_bytes": expert_parameter_bytes(model)[0],
                "experts": [m.quantization for m in model.modules() if isinstance(m, FusedMoE)],
                "int8_prefixes": sum(1 for method in getattr(model, "quantization", {}).values() if method == "int8")}
    finally:
        llm.shutdown()


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_int8_experts_keep_fp32s_next_token_wherever_its_top2_gap_is_clear(name):
    fp32, int8 = _run(name, "fp32"), _run(name, "int8-experts")
    assert set(fp32["experts"]) == {None} and int8["experts"] and set(int8["experts"]) == {"int8"}
    assert int8["int8_prefixes"] == len(int8["experts"])  # the experts and nothing else
    reference, quantized = fp32["logprobs"], int8["logprobs"]
    kl = bench.mean_kl(reference, quantized)
    print(f"{name}: int8 experts, mean KL {kl:.5f}")
    assert kl < bench.BARS["int8"][0]
    top2 = reference.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > CLEAR_GAP
    assert clear.float().mean() > 0.3  # a third of the positions or more are decisive: not vacuous
    assert torch.equal(reference.argmax(-1)[clear], quantized.argmax(-1)[clear])


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_the_whole_model_in_int8_stays_within_the_dense_random_weight_bound(name):
    int8 = _run(name, "int8")
    assert set(int8["experts"]) == {"int8"} and int8["int8_prefixes"] > len(int8["experts"])
    kl = bench.mean_kl(_run(name, "fp32")["logprobs"], int8["logprobs"])
    print(f"{name}: whole model int8, mean KL {kl:.5f}")
    assert kl < 0.1


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_int8_experts_greedy_tokens_part_from_fp32s_only_at_near_ties(name):
    same = total = 0
    for a, b in zip(_run(name, "fp32")["greedy"], _run(name, "int8-experts")["greedy"]):
        assert len(a.token_ids) == len(b.token_ids) == 16
        for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
            if x != y:
                assert x in b.logprobs[i] and y in a.logprobs[i], (a.token_ids, b.token_ids)
                break
            same += 1
        total += 16
    print(f"{name}: int8 experts' greedy tokens equal to fp32's before each prompt's first difference: {same} / {total}")


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_int8_experts_take_about_a_quarter_of_the_fp32_expert_bytes(name):
    fp32, int8 = _run(name, "fp32")["expert_bytes"], _run(name, "int8")["expert_bytes"]
    print(f"{name}: expert bytes fp32 {fp32}, int8 {int8} ({int8 / fp32:.3f})")
    # int8 values, plus one float32 scale per output row of each expert (and any float biases)
    assert 0.25 < int8 / fp32 < 0.3
