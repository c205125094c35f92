"""Multi-LoRA through ``gridserve.LLM`` (vLLM's offline API): the engine, its scheduler and real
worker processes, against transformers + PEFT generating greedily on the same weights.

One tiny Llama, two random PEFT adapters (``init_lora_weights=False``): "attn" (rank 8 on q/k/v/o)
and "mlp" (rank 16 on every projection). A batch mixing the base model and both adapters gives each
request PEFT's greedy tokens; TP=2 (worker processes over gloo), int8 base weights and two DP
engines give the same tokens; a burst on more adapters than ``max_loras`` completes.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from gridserve import LLM, LoRARequest, SamplingParams
from gridserve.shared.errors import InvalidArgumentError
from tests.zoo import peft_adapter, zoo_checkpoint

pytest.importorskip("peft")

_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "max_position_embeddings": 256, "tie_word_embeddings": False}
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
PROMPTS = [[5, 17, 300, 41, 2000, 9, 77, 8], [100, 200, 300, 400, 500], list(range(600, 630)), [7, 8, 9, 10, 11]]
MAX_TOKENS = 8
KV_BYTES = 4 << 20
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@functools.cache
def base() -> Path:
    return zoo_checkpoint("lora-llm-llama", "LlamaConfig", **_SHAPE)


@pytest.fixture(scope="module")
def loras(tmp_path_factory) -> dict[str, LoRARequest]:
    root = tmp_path_factory.mktemp("adapters")
    attn = peft_adapter(base(), root / "attn", ATTN, rank=8, seed=1)
    mlp = peft_adapter(base(), root / "mlp", ATTN + ["gate_proj", "up_proj", "down_proj"], rank=16, seed=2,
                       use_rslora=True)
    return {"attn": LoRARequest("attn", 1, str(attn)), "mlp": LoRARequest("mlp", 2, str(mlp))}


@functools.cache
def _peft_greedy(adapter: str | None, prompt: tuple[int, ...]) -> list[int]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base(), dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                             min_new_tokens=MAX_TOKENS, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _mixed(loras) -> list[LoRARequest | None]:
    return [None, loras["attn"], loras["mlp"], loras["attn"]]


def _tokens(llm: LLM, requests) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=requests)]


def test_a_mixed_batch_gives_every_request_pefts_greedy_tokens(loras):
    llm = LLM(model=str(base()), kv_cache_memory_bytes=KV_BYTES, enable_lora=True, max_loras=2)
    try:
        requests = _mixed(loras)
        got = _tokens(llm, requests)
        for prompt, lora, tokens in zip(PROMPTS, requests, got):
            assert tokens == _peft_greedy(lora.lora_path if lora else None, tuple(prompt)), lora
        assert got[1] != _peft_greedy(None, tuple(PROMPTS[1])), "the adapter changes the output"
        # again: the adapters are cached in the worker and the prefix cache holds their prompts
        assert _tokens(llm, requests) == got
        with pytest.raises(InvalidArgumentError, match="lora_request"):
            llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=requests[:2])
    finally:
        llm.shutdown()


def test_more_adapters_than_max_loras_in_one_burst_all_complete(loras, tmp_path):
    third = LoRARequest("third", 3, str(peft_adapter(base(), tmp_path / "third", ["q_proj", "v_proj"], seed=3)))
    llm = LLM(model=str(base()), kv_cache_memory_bytes=KV_BYTES, enable_lora=True, max_loras=1, max_cpu_loras=2)
    try:
        requests = [loras["attn"], loras["mlp"], third, None] * 3
        outs = llm.generate([PROMPTS[i % 4] for i in range(12)], GREEDY, use_tqdm=False, lora_request=requests)
        assert all(len(o.outputs[0].token_ids) == MAX_TOKENS for o in outs)
        for i, (out, lora) in enumerate(zip(outs, requests)):
            if lora is not third:  # with one adapter a step and two kept: evicted and reloaded, same tokens
                assert out.outputs[0].token_ids == _peft_greedy(lora.lora_path if lora else None, tuple(PROMPTS[i % 4]))
    finally:
        llm.shutdown()


@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2}, {"data_parallel_size": 2}],
                         ids=["tp2", "dp2"])
def test_tensor_and_data_parallel_give_the_single_workers_tokens(loras, parallel):
    llm = LLM(model=str(base()), kv_cache_memory_bytes=KV_BYTES, enable_lora=True, max_loras=2, **parallel)
    try:
        requests = _mixed(loras)
        for prompt, lora, tokens in zip(PROMPTS, requests, _tokens(llm, requests)):
            assert tokens == _peft_greedy(lora.lora_path if lora else None, tuple(prompt)), (parallel, lora)
    finally:
        llm.shutdown()


def test_int8_base_weights_keep_the_adapters(loras):
    plain = LLM(model=str(base()), kv_cache_memory_bytes=KV_BYTES, quantization="int8")
    try:
        base_tokens = _tokens(plain, None)
    finally:
        plain.shutdown()
    llm = LLM(model=str(base()), kv_cache_memory_bytes=KV_BYTES, enable_lora=True, max_loras=2, quantization="int8")
    try:
        requests = _mixed(loras)
        got = _tokens(llm, requests)
        assert got[0] == base_tokens[0], "a base-model request in a LoRA batch is the int8 model's"
        for i in (1, 2, 3):
            assert got[i] != base_tokens[i], "the adapter still changes the int8 model's output"
            # (int8 + adapter against PEFT's exact delta: tests/unit/worker/test_lora_matches_peft.py)
            alone = llm.generate([PROMPTS[i]], GREEDY, use_tqdm=False, lora_request=requests[i])
            assert alone[0].outputs[0].token_ids == got[i], "the same tokens alone as in the mixed batch"
    finally:
        llm.shutdown()


def test_a_bad_adapter_is_refused_naming_the_field_and_lora_off_refuses_requests(loras, tmp_path):
    big = LoRARequest("big", 9, str(peft_adapter(base(), tmp_path / "big", ATTN, rank=32, seed=4)))
    llm = LLM(model=str(base()), kv_cache_memory_bytes=KV_BYTES, enable_lora=True, max_lora_rank=16)
    try:
        with pytest.raises(InvalidArgumentError, match=r"\br\b|rank"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=big)
        with pytest.raises(InvalidArgumentError, match="lora_path"):
            llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("gone", 10, str(tmp_path / "none")))
        # the engine is unharmed: the good adapters still serve
        out = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=loras["attn"])
        assert out[0].outputs[0].token_ids == _peft_greedy(loras["attn"].lora_path, tuple(PROMPTS[0]))
    finally:
        llm.shutdown()
    off = LLM(model=str(base()), kv_cache_memory_bytes=KV_BYTES)
    try:
        with pytest.raises(InvalidArgumentError, match="enable_lora"):
            off.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=loras["attn"])
    finally:
        off.shutdown()
