"""Reading PEFT adapters: what cannot be served exactly is refused with an error naming the field
(``lora_path`` for the files, ``adapter_config.<field>`` for the adapter), and nothing is loaded.

A valid adapter is made with ``peft`` on a tiny Llama and then broken one way per test.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gridserve.services.worker.loader import load_model
from gridserve.services.worker.lora import LoRAManager
from gridserve.services.worker.parallel_state import ParallelState, set_parallel_state
from gridserve.shared.config import GridserveConfig, LoRAConfig
from gridserve.shared.errors import InvalidArgumentError
from gridserve.shared.lora import LoRARequest
from tests.zoo import zoo_checkpoint

_BASE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 24, "max_position_embeddings": 512, "tie_word_embeddings": False}
LAYER0 = "base_model.model.model.layers.0"


@functools.cache
def _checkpoint() -> str:
    return str(zoo_checkpoint("lora-llama", "LlamaConfig", **_BASE))


def _peft_adapter(folder: Path, **config) -> Path:
    import peft
    from transformers import AutoModelForCausalLM

    config = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"], "init_lora_weights": False, **config}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(_checkpoint(), dtype=torch.float32)
    peft.get_peft_model(model, peft.LoraConfig(**config)).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    return _peft_adapter(tmp_path_factory.mktemp("lora") / "good")


@pytest.fixture
def manager() -> LoRAManager:
    set_parallel_state(ParallelState.single())
    config = GridserveConfig.from_kwargs(model=_checkpoint(), device="cpu").finalize()
    return LoRAManager(load_model(config, torch.device("cpu")),
                       LoRAConfig(enable_lora=True, max_loras=2, max_lora_rank=16), torch.device("cpu"), torch.float32)


def _copy(good: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(good, tmp_path / "adapter"))


def _edit_config(folder: Path, **fields) -> Path:
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
    return folder


def _edit_weights(folder: Path, edit) -> Path:
    path = folder / "adapter_model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)
    return folder


def _refused(manager: LoRAManager, folder, field: str) -> str:
    with pytest.raises(InvalidArgumentError) as info:
        manager.add(LoRARequest("bad", 5, str(folder)))
    assert info.value.field == field, str(info.value)
    assert manager.list() == [] and not manager.slots  # nothing loaded
    return info.value.message


def test_a_peft_adapter_maps_onto_the_merged_qkv_layer(manager, good):
    adapter = manager.add(LoRARequest("good", 1, str(good)))
    assert manager.list() == [1]
    a, b = adapter.weights["model.layers.0.self_attn.qkv_proj"]
    raw = load_file(good / "adapter_model.safetensors")
    q_a, v_a = raw[f"{LAYER0}.self_attn.q_proj.lora_A.weight"], raw[f"{LAYER0}.self_attn.v_proj.lora_A.weight"]
    q_b = raw[f"{LAYER0}.self_attn.q_proj.lora_B.weight"]
    assert a.shape == (48, 64) and b.shape == (96 + 48 + 48, 48)  # rank 16 x 3 sub-matrices; q 96, k 48, v 48 rows
    torch.testing.assert_close(a[:8], q_a)
    torch.testing.assert_close(a[32:40], v_a)
    assert not a[8:32].any() and not a[40:].any()  # k untargeted, ranks zero padded
    torch.testing.assert_close(b[:96, :8], q_b * 2.0)  # alpha / r = 2 folded into B
    assert not b[:96, 8:].any() and not b[96:144].any()  # block-diagonal; k's rows zero
    assert "model.layers.0.mlp.gate_up_proj" not in adapter.weights
    manager.remove(1)
    assert manager.list() == []


def test_missing_folder_is_refused(manager, tmp_path):
    _refused(manager, tmp_path / "nowhere", "lora_path")


def test_folder_without_config_is_refused(manager, good, tmp_path):
    folder = _copy(good, tmp_path)
    (folder / "adapter_config.json").unlink()
    assert "adapter_config.json" in _refused(manager, folder, "lora_path")


def test_pickled_weights_are_refused_and_never_unpickled(manager, good, tmp_path, monkeypatch):
    folder = _copy(good, tmp_path)
    (folder / "adapter_model.safetensors").rename(folder / "adapter_model.bin")
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load called on an adapter"))
    assert "pickle" in _refused(manager, folder, "lora_path")


def test_rank_above_max_lora_rank_is_refused(manager, tmp_path):
    folder = _peft_adapter(tmp_path / "r32", r=32)
    assert "max_lora_rank=16" in _refused(manager, folder, "adapter_config.r")


def test_rank_pattern_above_max_lora_rank_is_refused(manager, good, tmp_path):
    _refused(manager, _edit_config(_copy(good, tmp_path), rank_pattern={"v_proj": 64}), "adapter_config.rank_pattern.v_proj")


@pytest.mark.parametrize("modules", [["lm_head"], ["embed_tokens"]])
def test_embeddings_and_lm_head_are_refused(manager, tmp_path, modules):
    folder = _peft_adapter(tmp_path / modules[0], target_modules=["q_proj", *modules])
    _refused(manager, folder, "adapter_config.target_modules")


def test_a_module_the_model_lacks_is_refused(manager, good, tmp_path):
    def rename(tensors):
        for ab in "AB":
            tensors[f"{LAYER0}.self_attn.c_attn.lora_{ab}.weight"] = tensors.pop(f"{LAYER0}.self_attn.q_proj.lora_{ab}.weight")

    assert "c_attn" in _refused(manager, _edit_weights(_copy(good, tmp_path), rename), "adapter_config.target_modules")


def test_moe_experts_are_refused(manager, good, tmp_path):
    def add_expert(tensors):
        tensors[f"{LAYER0}.mlp.experts.0.gate_proj.lora_A.weight"] = torch.zeros(8, 64)
        tensors[f"{LAYER0}.mlp.experts.0.gate_proj.lora_B.weight"] = torch.zeros(128, 8)

    _refused(manager, _edit_weights(_copy(good, tmp_path), add_expert), "adapter_config.target_modules")


@pytest.mark.parametrize("field, value", [("modules_to_save", ["lm_head"]), ("use_dora", True), ("bias", "all"),
                                          ("lora_bias", True), ("peft_type", "IA3")])
def test_unsupported_features_are_refused(manager, good, tmp_path, field, value):
    _refused(manager, _edit_config(_copy(good, tmp_path), **{field: value}), f"adapter_config.{field}")


def test_an_adapter_of_another_base_model_is_refused(manager, good, tmp_path):
    def widen(tensors):
        tensors[f"{LAYER0}.self_attn.q_proj.lora_A.weight"] = torch.zeros(8, 128)

    assert "another base model" in _refused(manager, _edit_weights(_copy(good, tmp_path), widen), "lora_path")


def test_half_a_pair_is_refused(manager, good, tmp_path):
    folder = _edit_weights(_copy(good, tmp_path), lambda t: t.pop(f"{LAYER0}.self_attn.v_proj.lora_B.weight"))
    _refused(manager, folder, "lora_path")


def test_a_failed_load_keeps_the_loaded_adapters(manager, good, tmp_path):
    manager.add(LoRARequest("good", 1, str(good)))
    with pytest.raises(InvalidArgumentError):
        manager.add(LoRARequest("bad", 2, str(tmp_path / "nowhere")))
    assert manager.list() == [1]


def test_a_corrupt_weights_file_is_refused(manager, good, tmp_path):
    folder = _copy(good, tmp_path)
    (folder / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    assert "not readable" in _refused(manager, folder, "lora_path")


def test_a_layer_beyond_the_models_layers_is_refused(manager, good, tmp_path):
    def add_layer(tensors):
        for ab in "AB":
            tensors[f"base_model.model.model.layers.9.self_attn.q_proj.lora_{ab}.weight"] = (
                tensors[f"{LAYER0}.self_attn.q_proj.lora_{ab}.weight"].clone())

    assert "model.layers.9" in _refused(manager, _edit_weights(_copy(good, tmp_path), add_layer),
                                        "adapter_config.target_modules")
