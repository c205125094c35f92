"""Builds a model from its config and fills it with the checkpoint's weights.

The model is built on the meta device (each tensor-parallel rank builds only its shard), moved to
the device uninitialised, and filled by its ``load_weights`` from lazily read checkpoint tensors:
a sharded layer reads only its slice, and ``LoadReport`` records how much of each tensor was read
(the checkpoint types are in ``checkpoint``; a ``.gguf`` file's tensors come from ``gguf_loader``).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from gridserve.services.worker.attention import PagedAttention
from gridserve.services.worker.checkpoint import LoadReport, iterate_weights
from gridserve.services.worker.gguf_loader import iterate_gguf_weights
from gridserve.services.worker.models import construct_model, get_model_class
from gridserve.services.worker.quantization import (
    QuantizationConfig,
    QuantizedWeight,
    compressed_tensors,
    quantize_model,
)
from gridserve.shared.config import GridserveConfig
from gridserve.shared.errors import ModelNotFoundError
from gridserve.shared.gguf_config import is_gguf

logger = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# ``GridserveConfig.kv_cache_dtype`` (resolved) -> the KV cache's storage dtype.
KV_CACHE_TORCH_DTYPES = {**TORCH_DTYPES, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                         "fp8_e5m2": torch.float8_e5m2}


def load_model(config: GridserveConfig, device: torch.device) -> nn.Module:
    """Instantiate the architecture on ``device`` without random init, then copy the weights in."""
    convert = None if config.model.convert == "auto" else config.model.convert
    model_class = get_model_class(config.model.architecture, convert)
    dtype = TORCH_DTYPES[config.model.resolved_dtype]
    with torch.device("meta"):
        model = construct_model(model_class, config)
    model = model.to_empty(device=device).to(dtype)
    report = LoadReport()
    if is_gguf(config.model.model_path):  # one GGUF file: tensors dequantized at load
        weights = iterate_gguf_weights(config.model.model_path, config.model.hf_config, report)
    else:
        weights = iterate_weights(config.model.model_path, report)
    prequantized = None
    if config.model.quantization == "compressed-tensors":
        prequantized = compressed_tensors.scheme_of(config.model.hf_config["quantization_config"])
        weights = compressed_tensors.dequantized_weights(weights, prequantized, report)
    loaded = model.load_weights(weights)
    missing = {name for name, _ in model.named_parameters()} - loaded
    if missing:
        raise ModelNotFoundError(
            f"checkpoint {config.model.model_path!r} lacks weights for: {', '.join(sorted(missing)[:8])}"
        )
    _reset_non_persistent(model, device)
    _quantize(model, config, prequantized)
    model.load_report = report
    logger.info("loaded %s (%s, quantization %s) on %s: %.1f MiB of weights", config.model.architecture,
                config.model.resolved_dtype, config.model.quantization or "none", device,
                parameter_bytes(model) / 2**20)
    return model.eval()


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of the weights as held: float parameters plus quantized values and scales."""
    quantized = sum(m.nbytes() for m in model.modules() if isinstance(m, QuantizedWeight))
    return sum(p.numel() * p.element_size() for p in model.parameters()) + quantized


def _quantize(model: nn.Module, config: GridserveConfig, prequantized=None) -> None:
    """Quantize this rank's shards by the per-layer config (no-op without ``quantization``), or
    re-quantize the layers a pre-quantized checkpoint stored packed (``prequantized``)."""
    quant = prequantized or QuantizationConfig.from_model_config(config.model.quantization,
                                                                 config.model.quantization_config)
    if quant is not None:
        model.quantization = quantize_model(model, quant, config.model.num_layers)


def _reset_non_persistent(model: nn.Module, device: torch.device) -> None:
    """Modules built on the meta device lose plain tensors; recreate what they need."""
    for module in model.modules():
        if isinstance(module, PagedAttention):
            module.kv_cache = torch.empty(0, device=device)
