"""Sliding windows across both decoder families (``services/worker/models/windows.py``): a window
that is not a positive integer is refused at start naming ``model.hf_config.sliding_window``; a
window model says at start that its KV cache keeps only the window (one helper for Llama-family and
LayerNorm-family models); the registry's ``kv_kind`` says ``sliding`` for every architecture whose
config can turn windows on. Models are built on the meta device from a config.json alone."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from gridserve.services.worker.models import construct_model, get_model_class
from gridserve.shared.config import GridserveConfig
from gridserve.shared.errors import ConfigError
from gridserve.shared.model_registry import ARCHITECTURES

WINDOWS_LOGGER = "gridserve.services.worker.models.windows"
_SIZES = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 4096, "max_position_embeddings": 512}
CONFIGS: dict[str, dict[str, Any]] = {
    "MistralForCausalLM": {"model_type": "mistral", **_SIZES},
    "Qwen2ForCausalLM": {"model_type": "qwen2", **_SIZES, "use_sliding_window": True, "max_window_layers": 1},
    "Gemma2ForCausalLM": {"model_type": "gemma2", **_SIZES, "head_dim": 16},
    "Starcoder2ForCausalLM": {"model_type": "starcoder2", **_SIZES},
}


def _build(tmp_path: Path, architecture: str, **config: Any) -> torch.nn.Module:
    """``architecture``'s model for a checkpoint holding only its config.json, on the meta device."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [architecture], **CONFIGS[architecture],
                                                      **config}))
    engine = GridserveConfig.from_kwargs(model=str(tmp_path)).finalize()
    with torch.device("meta"):
        return construct_model(get_model_class(architecture), engine)


@pytest.mark.parametrize("architecture", list(CONFIGS))
@pytest.mark.parametrize("window", [0, -8, 2.5, "32"])
def test_a_window_that_is_not_a_positive_integer_is_refused_naming_the_field(architecture, window, tmp_path):
    with pytest.raises(ConfigError) as info:
        _build(tmp_path, architecture, sliding_window=window)
    assert info.value.field == "model.hf_config.sliding_window" and repr(window) in str(info.value)


@pytest.mark.parametrize("architecture", ["Starcoder2ForCausalLM", "MistralForCausalLM"])
def test_a_window_model_says_at_start_that_its_kv_cache_keeps_only_the_window(architecture, tmp_path, caplog):
    with caplog.at_level("INFO", logger=WINDOWS_LOGGER):
        model = _build(tmp_path, architecture, sliding_window=32)
    warnings = [r.getMessage() for r in caplog.records if r.name == WINDOWS_LOGGER]
    assert len(warnings) == 1
    assert warnings[0].startswith(f"{architecture}: 2 of 2 layers use a sliding window (32 tokens)")
    assert "keeps only the window" in warnings[0]
    assert [a.sliding_window for a in model.attention_layers()] == [32, 32]


@pytest.mark.parametrize("architecture", ["Starcoder2ForCausalLM", "MistralForCausalLM"])
def test_a_window_no_sequence_can_outgrow_is_full_attention_without_a_word(architecture, tmp_path, caplog):
    with caplog.at_level("INFO", logger=WINDOWS_LOGGER):
        model = _build(tmp_path, architecture, sliding_window=512)  # = max_model_len
    assert not [r for r in caplog.records if r.name == WINDOWS_LOGGER]
    assert [a.sliding_window for a in model.attention_layers()] == [None, None]


# ---- the registry's kv_kind ---------------------------------------------------------------------------
# each architecture whose config can turn windows on: its transformers config with a window set
_WINDOWED = {
    "MistralForCausalLM": ("MistralConfig", {}),
    "MixtralForCausalLM": ("MixtralConfig", {"num_local_experts": 2, "num_experts_per_tok": 1}),
    "Qwen2ForCausalLM": ("Qwen2Config", {"use_sliding_window": True, "max_window_layers": 1}),
    "Qwen3ForCausalLM": ("Qwen3Config", {"use_sliding_window": True, "max_window_layers": 1}),
    "Qwen2MoeForCausalLM": ("Qwen2MoeConfig", {"use_sliding_window": True, "max_window_layers": 1}),
    "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", {"use_sliding_window": True}),
    "SmolLM3ForCausalLM": ("SmolLM3Config", {"use_sliding_window": True, "no_rope_layer_interval": 2}),
    "Phi3ForCausalLM": ("Phi3Config", {}),
    "Gemma2ForCausalLM": ("Gemma2Config", {}),
    "Gemma3ForCausalLM": ("Gemma3TextConfig", {}),
    "Starcoder2ForCausalLM": ("Starcoder2Config", {}),
    "GptOssForCausalLM": ("GptOssConfig", {"num_local_experts": 2, "num_experts_per_tok": 1}),
}


def _windows(architecture: str, config_class: str, config: dict) -> list:
    import transformers

    hf = getattr(transformers, config_class)(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                                             sliding_window=16, **config)
    spec = get_model_class(architecture).decoder_spec(SimpleNamespace(**hf.to_dict()))
    return list(spec.windows) if hasattr(spec, "windows") else [spec.attention.sliding_window] * hf.num_hidden_layers


def test_the_registry_says_sliding_for_exactly_the_architectures_that_can_take_a_window():
    for architecture, (config_class, config) in _WINDOWED.items():
        assert 16 in _windows(architecture, config_class, config), architecture
    sliding = {name for name, info in ARCHITECTURES.items() if info.kv_kind == "sliding"}
    assert sliding == set(_WINDOWED)


def test_an_olmo3_gguf_file_is_refused_naming_its_window_key():
    """OLMo 3 shares OLMo 2's GGUF name and adds windows, which gridserve's OLMo 2 does not have."""
    from gridserve.shared.gguf_architectures import GgufMetadata, olmo2

    file = SimpleNamespace(path="/models/olmo3.gguf", tensors=[],
                           get=lambda key, default=None: {"olmo2.attention.sliding_window": 4096}.get(key, default))
    with pytest.raises(ConfigError) as info:
        olmo2(GgufMetadata(file, "olmo2"))
    assert info.value.field == "model.model"
    assert "olmo2.attention.sliding_window" in str(info.value) and "OLMo 3" in str(info.value)
