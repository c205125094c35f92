"""Checkpoints load from every supported on-disk form, in every supported dtype."""

from __future__ import annotations

import shutil

import pytest

from gridserve import LLM, SamplingParams

PROMPTS = [{"prompt_token_ids": list(range(40, 75))}, {"prompt_token_ids": [9, 8, 7]}]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _tokens(path, **kwargs) -> list[list[int]]:
    llm = LLM(model=str(path), kv_cache_memory_bytes=16 << 20, max_model_len=256, **kwargs)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _resave(src, dst, **save_kwargs):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    if save_kwargs.pop("as_bin", False):  # the legacy format transformers 5 no longer writes
        model.config.save_pretrained(dst)
        torch.save(model.state_dict(), dst / "pytorch_model.bin")
    else:
        model.save_pretrained(dst, **save_kwargs)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        if (src / name).exists():
            shutil.copy(src / name, dst / name)


@pytest.fixture(scope="module")
def reference_tokens(llama_tiny):
    return _tokens(llama_tiny)


def test_sharded_safetensors_with_index_load_like_one_file(llama_tiny, tmp_path, reference_tokens):
    _resave(llama_tiny, tmp_path, safe_serialization=True, max_shard_size="200KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    assert _tokens(tmp_path) == reference_tokens


def test_pytorch_model_bin_loads_like_safetensors(llama_tiny, tmp_path, reference_tokens):
    _resave(llama_tiny, tmp_path, as_bin=True)
    assert not list(tmp_path.glob("*.safetensors")) and list(tmp_path.glob("pytorch_model*.bin"))
    assert _tokens(tmp_path) == reference_tokens


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_dtypes_generate(llama_tiny, dtype):
    llm = LLM(model=str(llama_tiny), dtype=dtype, kv_cache_memory_bytes=16 << 20, max_model_len=256)
    assert llm.llm_engine.core.executor.worker.runner.kv_caches[0].dtype.__str__() == f"torch.{dtype}"
    out = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 8 for o in out)


def test_folder_without_weights_is_a_clear_error(llama_tiny, tmp_path):
    shutil.copy(llama_tiny / "config.json", tmp_path / "config.json")
    shutil.copy(llama_tiny / "tokenizer.json", tmp_path / "tokenizer.json")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLM(model=str(tmp_path), kv_cache_memory_bytes=16 << 20)
