"""Model implementations, looked up by the ``architectures`` entry of the checkpoint's config.json."""

from __future__ import annotations

import importlib

from gridserve.shared.errors import ConfigError

# architecture name -> "module:Class", imported only when used
_REGISTRY = {
    "LlamaForCausalLM": "llama:LlamaForCausalLM",
    "MistralForCausalLM": "llama:MistralForCausalLM",
    "MixtralForCausalLM": "mixtral:MixtralForCausalLM",
    "Qwen2ForCausalLM": "llama:Qwen2ForCausalLM",
    "OPTForCausalLM": "opt:OPTForCausalLM",
    "LlavaForConditionalGeneration": "llava:LlavaForConditionalGeneration",
}


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def get_model_class(architecture: str) -> type:
    target = _REGISTRY.get(architecture)
    if target is None:
        raise ConfigError(
            "model.architecture",
            f"{architecture!r} is not supported; supported: {', '.join(supported_architectures())}",
        )
    module_name, class_name = target.split(":")
    module = importlib.import_module(f"{__name__}.{module_name}")
    return getattr(module, class_name)
