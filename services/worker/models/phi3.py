"""Phi-3: the Llama decoder with pre-fused ``qkv_proj`` / ``gate_up_proj`` checkpoints, a sliding
window on every layer (when set) and LongRoPE (``rope_parameters.rope_type: longrope``, formerly
``su``) for the long-context variants.

LongRoPE is exact with transformers while sequences stay within
``original_max_position_embeddings``. Past it transformers' generate re-encodes the whole sequence
with the long factors (it drops its KV cache at the crossing); here a position's rotation depends on
the position alone (what prefix caching and chunked prefill need): positions from the original
length on take the long factors, earlier ones keep the short factors they were cached with, as
transformers' model computes it with a cache kept across the crossing.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

from gridserve.services.worker.layers import rope_parameters
from gridserve.services.worker.models.llama import DecoderSpec, LlamaForCausalLM, llama_spec
from gridserve.services.worker.weight_loader import LLAMA_STACKED, ROTARY_BUFFERS, WeightMap
from gridserve.shared.config import GridserveConfig

logger = logging.getLogger(__name__)


def phi3_rope(hf: Any) -> dict:
    """The RoPE parameters, with Phi-3's legacy ``su`` / ``yarn`` type names read as ``longrope``
    (as transformers' ``Phi3Config`` does; its ``original_max_position_embeddings`` takes priority)."""
    params = rope_parameters(hf)
    if params["rope_type"] in ("su", "yarn"):
        params["rope_type"] = "longrope"
        original = getattr(hf, "original_max_position_embeddings", None)
        params["original_max_position_embeddings"] = (original or params.get("original_max_position_embeddings")
                                                      or hf.max_position_embeddings)
    return params


class Phi3ForCausalLM(LlamaForCausalLM):
    # each checkpoint tensor is split across the merged module's shards, so TP ranks read their rows
    weight_map = WeightMap(skip=ROTARY_BUFFERS, stacked=LLAMA_STACKED, fused=("qkv_proj", "gate_up_proj"))

    def __init__(self, *, config: GridserveConfig, prefix: str = "") -> None:
        super().__init__(config=config, prefix=prefix)
        rope = self.spec.rope[0]
        original = rope.get("original_max_position_embeddings") or config.model.max_model_len
        if rope["rope_type"] == "longrope" and config.model.max_model_len > original:
            logger.warning("Phi-3 LongRoPE: sequences past original_max_position_embeddings=%d rotate only their "
                           "positions from %d on by the long factors (transformers re-encodes the whole sequence)",
                           original, original)

    @classmethod
    def decoder_spec(cls, hf: Any) -> DecoderSpec:
        spec = llama_spec(hf)
        return replace(spec, rope=(phi3_rope(hf),) * hf.num_hidden_layers)
