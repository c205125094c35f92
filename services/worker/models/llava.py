"""Llava: a CLIP vision tower, a two-layer projector and the Llama language model, composed.

Each part is built like any other module (``(*, config, prefix)``, TP-sharded, loaded lazily by
the same loader). Prefill: ``encode_images`` runs the tower on a request's images and projects
the selected layer's patch features (the CLS token dropped with the ``default`` strategy) into the
language model's embedding space; ``embed`` puts them at the image-token rows of the input
embeddings. Decoding is the language model's alone.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Optional

import torch
from torch import nn

from gridserve.services.worker.attention import AttentionMetadata, PagedAttention
from gridserve.services.worker.checkpoint import CheckpointTensor
from gridserve.services.worker.models.clip import CLIPVisionModel, activation
from gridserve.services.worker.models.hf_config import hf_config_of
from gridserve.services.worker.models.llama import LlamaForCausalLM
from gridserve.services.worker.parallel_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    add_prefix,
)
from gridserve.services.worker.parallel_state import ParallelState, get_parallel_state
from gridserve.shared.config import GridserveConfig
from gridserve.shared.errors import ConfigError
from gridserve.shared.parallel import even_shard

# transformers 5 checkpoint names -> the 4.x layout this model follows
_RENAMES = (
    ("model.language_model.", "language_model.model."),
    ("lm_head.", "language_model.lm_head."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
    ("vision_tower.vision_model.", "vision_tower."),
)
_STRATEGIES = ("default", "full")


class LlavaMultiModalProjector(nn.Module):
    """``linear_2(act(linear_1(features)))``: vision width to the language model's width."""

    def __init__(self, vision_hidden: int, text_hidden: int, act: str, bias: bool, state: ParallelState,
                 prefix: str = "") -> None:
        super().__init__()
        inner = even_shard(text_hidden, state.tp_size, state.tp_rank, "text_config.hidden_size")
        self.linear_1 = ColumnParallelLinear(vision_hidden, [inner], bias=bias, prefix=add_prefix(prefix, "linear_1"))
        self.act = activation(act, "model.hf_config.projector_hidden_act")
        self.linear_2 = RowParallelLinear(inner, text_hidden, bias=bias, state=state,
                                          prefix=add_prefix(prefix, "linear_2"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))


def text_config_of(config: GridserveConfig) -> GridserveConfig:
    """``config`` with the language model's ``text_config`` as the model's config."""
    text = copy.copy(config)
    text.model = copy.copy(config.model)
    text.model.hf_config = config.model.text_config
    return text


class LlavaForConditionalGeneration(nn.Module):
    def __init__(self, *, config: GridserveConfig, prefix: str = "") -> None:
        super().__init__()
        hf = hf_config_of(config)
        vision = hf_config_of(_with_hf(config, hf.vision_config))
        self.state = get_parallel_state()
        self.strategy = getattr(hf, "vision_feature_select_strategy", "default")
        if self.strategy not in _STRATEGIES:
            raise ConfigError("model.hf_config.vision_feature_select_strategy",
                              f"{self.strategy!r}; supported: {', '.join(_STRATEGIES)}")
        self.image_token_id = int(getattr(hf, "image_token_index", None) or hf.image_token_id)
        self.vision_tower = CLIPVisionModel(vision, getattr(hf, "vision_feature_layer", -2), self.state,
                                            add_prefix(prefix, "vision_tower"))
        text_hidden = config.model.text_config["hidden_size"]
        self.multi_modal_projector = LlavaMultiModalProjector(
            vision.hidden_size, text_hidden, getattr(hf, "projector_hidden_act", "gelu"),
            getattr(hf, "multimodal_projector_bias", True), self.state, add_prefix(prefix, "multi_modal_projector"))
        self.language_model = LlamaForCausalLM(config=text_config_of(config), prefix=add_prefix(prefix, "language_model"))

    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[images, channels, H, W]`` -> ``[images, tokens, text hidden]``: one row per image token."""
        features = self.vision_tower(pixel_values)
        if self.strategy == "default":
            features = features[:, 1:]
        return self.multi_modal_projector(features)

    def embed(self, input_ids: torch.Tensor, rows: torch.Tensor, image_embeds: torch.Tensor) -> torch.Tensor:
        """The input embeddings with ``image_embeds`` at packed ``rows`` (the image tokens)."""
        embeds = self.language_model.model.embed_tokens(input_ids)
        embeds[rows] = image_embeds.to(embeds.dtype)
        return embeds

    def forward(self, input_ids, positions, meta: AttentionMetadata, intermediate=None,
                inputs_embeds: Optional[torch.Tensor] = None):
        return self.language_model(input_ids, positions, meta, intermediate, inputs_embeds=inputs_embeds)

    def compute_logits(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        return self.language_model.compute_logits(hidden)

    def attention_layers(self) -> list[PagedAttention]:
        return self.language_model.attention_layers()

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> set[str]:
        """Route each tensor to its part (the language model, the tower, the projector)."""
        parts = {"language_model.": self.language_model, "vision_tower.": self.vision_tower,
                 "multi_modal_projector.": self.multi_modal_projector}
        loaded: set[str] = set()
        for name, tensor in weights:
            name = _normalise(name)
            part = next((p for p in parts if name.startswith(p)), None)
            if part is None:
                raise KeyError(f"checkpoint tensor {name!r} has no place in LlavaForConditionalGeneration")
            module = parts[part]
            local = name[len(part):]
            if module is self.multi_modal_projector:
                loaded |= {part + n for n in _load_plain(module, local, tensor)}
            else:
                loaded |= {part + n for n in module.load_weights([(local, tensor)])}
        return loaded


def _normalise(name: str) -> str:
    for old, new in _RENAMES:
        if name.startswith(old):
            name = new + name[len(old):]
    return name


def _load_plain(module: nn.Module, name: str, tensor: CheckpointTensor) -> set[str]:
    module_name, _, param_name = name.rpartition(".")
    module.get_submodule(module_name).load(param_name, tensor, 0)
    return {name}


def _with_hf(config: GridserveConfig, hf_config: dict) -> GridserveConfig:
    sub = copy.copy(config)
    sub.model = copy.copy(config.model)
    sub.model.hf_config = dict(hf_config)
    return sub
