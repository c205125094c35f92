"""Weight quantization at load: each rank quantizes the shard it read, layer by layer, by prefix.

``quantize_model`` runs after the checkpoint is loaded and before the KV cache is allocated:
every ``QuantizableLinear`` (column / row-parallel layers, the LM head) asks the config for its
method and swaps its float weight for a ``QuantizedWeight``; every MoE layer's routed experts
(``FusedMoE``, prefix ``model.layers.N.mlp.experts``) are quantized the same way, expert by
expert (``QuantizedExperts``, ``experts.py``), only those this rank holds (its TP shard, its
expert-parallel share). Routers stay float. Pre-quantized checkpoints (compressed-tensors) are
read by ``compressed_tensors.load`` instead (their experts, dequantized, stay float).
"""

from __future__ import annotations

import logging
import re

from torch import nn

from gridserve.services.worker.quantization.config import QuantizationConfig
from gridserve.services.worker.quantization.experts import QuantizedExperts
from gridserve.services.worker.quantization.weights import (
    Int4Weight,
    Int8Weight,
    QuantizedWeight,
    quantize_weight,
)

logger = logging.getLogger(__name__)
_LAYER_INDEX = re.compile(r"\.layers\.(\d+)\.")

__all__ = [
    "Int4Weight",
    "Int8Weight",
    "QuantizationConfig",
    "QuantizedExperts",
    "QuantizedWeight",
    "quantize_model",
    "quantize_weight",
]


def quantize_model(
    model: nn.Module, config: QuantizationConfig, num_layers: int = 0
) -> dict[str, str]:
    """Quantize every linear layer and every MoE layer's experts of ``model`` the config does not
    ignore; returns prefix -> method ("none" for the ignored ones). ``num_layers``: the whole model's
    decoder layers (a pipeline stage holds only some; ignore entries may name the others)."""
    from gridserve.services.worker.fused_moe import FusedMoE
    from gridserve.services.worker.parallel_layers import QuantizableLinear, VocabParallelEmbedding

    chosen: dict[str, str] = {}
    moe_prefixes: set[str] = set()
    head = getattr(model, "logits_head", None)
    for name, module in list(model.named_modules()):  # quantizing adds modules
        if isinstance(module, FusedMoE):
            _quantize_experts(module, name, config, chosen)
            moe_prefixes.add(name)
            continue
        if not isinstance(module, QuantizableLinear):
            continue
        if module is head:
            prefix = "lm_head"  # a tied head answers to lm_head, as in vLLM's configs
        elif isinstance(module, VocabParallelEmbedding):
            continue  # an embedding that is not the head: lookups stay float
        else:
            prefix = module.prefix
        method = config.method_for(prefix)
        chosen[prefix] = method or "none"
        if method is not None:
            module.quantize(method, config.group_size, config.activations, config.activation_rows,
                            config.activation_group)
    config.check_all_matched(_other_stages(chosen, num_layers))
    counts = {m: sum(1 for v in chosen.values() if v == m) for m in set(chosen.values())}
    moe = {m: sum(1 for p, v in chosen.items() if v == m and p in moe_prefixes) for m in set(chosen.values())}
    logger.info("quantized layers by method: %s (of which MoE layers' experts: %s)", counts, moe)
    return chosen


def _quantize_experts(experts, prefix: str, config: QuantizationConfig, chosen: dict[str, str]) -> None:
    """A ``FusedMoE``'s experts (``prefix``: its module path, the checkpoint's ``...mlp.experts``)."""
    method = config.method_for(prefix)
    chosen[prefix] = method or "none"
    if method is not None:
        experts.quantize(method, config.group_size, config.activations, config.activation_rows,
                         config.activation_group)


def _other_stages(held: dict[str, str], num_layers: int) -> set[str]:
    """Prefixes of the layers this rank would hold at every layer index, plus the LM head."""
    names = {"lm_head"}
    for prefix in held:
        match = _LAYER_INDEX.search(prefix)
        if match:
            names.update(
                prefix[: match.start(1)] + str(i) + prefix[match.end(1) :]
                for i in range(num_layers)
            )
    return names - set(held)
