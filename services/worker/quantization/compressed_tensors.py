"""Pre-quantized checkpoints in the compressed-tensors "pack-quantized" format (llm-compressor's
int8 / int4 weight-only output), detected from ``config.json``'s ``quantization_config``.

A quantized linear layer is stored as ``<prefix>.weight_packed`` (int32 words, element ``i`` at
bit ``i * num_bits``, values offset by ``2**(num_bits - 1)``), ``<prefix>.weight_scale``
([out, 1] per channel or [out, in / group_size] per group, symmetric: no zero point) and
``<prefix>.weight_shape``. ``dequantized_weights`` turns each such triple back into a float
``<prefix>.weight`` so the model loads (and shards) it as usual; ``quantize_model`` then quantizes
exactly those layers again with the checkpoint's scheme. Scales that are ``amax / 127`` (int8) or
``amax / 7`` (int4, gridserve's convention) round-trip bit-exactly; other conventions (e.g. an
observer's ``amax / 7.5``) are re-rounded once, a small extra error.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator

import torch

from gridserve.services.worker.checkpoint import CheckpointTensor, LoadReport
from gridserve.services.worker.quantization.config import QuantizationConfig
from gridserve.shared.errors import ConfigError

logger = logging.getLogger(__name__)

_PARTS = ("weight_packed", "weight_scale", "weight_shape")


def scheme_of(hf_quantization_config: dict) -> QuantizationConfig:
    """The int8 / int4 weight-only scheme of a compressed-tensors config (one config group)."""
    fmt = hf_quantization_config.get("format")
    if fmt != "pack-quantized":
        raise ConfigError(
            "model.quantization_config",
            f"compressed-tensors format {fmt!r} is not supported; supported: 'pack-quantized'",
        )
    groups = list((hf_quantization_config.get("config_groups") or {}).values())
    if len(groups) != 1 or groups[0].get("input_activations"):
        raise ConfigError(
            "model.quantization_config", "only one weight-only config group is supported"
        )
    weights = groups[0].get("weights") or {}
    bits, strategy = weights.get("num_bits"), weights.get("strategy")
    if (
        bits not in (4, 8)
        or not weights.get("symmetric", True)
        or weights.get("type", "int") != "int"
    ):
        raise ConfigError(
            "model.quantization_config", f"weights must be symmetric int4 or int8, got {weights}"
        )
    if bits == 8 and strategy != "channel":
        raise ConfigError(
            "model.quantization_config", f"int8 needs strategy 'channel', got {strategy!r}"
        )
    if bits == 4 and strategy != "group":
        raise ConfigError(
            "model.quantization_config", f"int4 needs strategy 'group', got {strategy!r}"
        )
    group = int(weights.get("group_size") or 128)
    return QuantizationConfig(
        "int8" if bits == 8 else "int4", group_size=group, only=set(), activations=False
    )


def unpack(packed: torch.Tensor, num_bits: int, columns: int) -> torch.Tensor:
    """int32 words [out, words] -> int8 values [out, columns] (little-endian words)."""
    data = packed.contiguous().view(torch.uint8)
    if num_bits == 8:
        values = data.to(torch.int16) - 128
    else:
        values = (
            torch.stack((data & 0xF, data >> 4), dim=-1)
            .reshape(packed.shape[0], -1)
            .to(torch.int16)
            - 8
        )
    return values[:, :columns].to(torch.int8)


def dequantized_weights(
    weights: Iterable[tuple[str, CheckpointTensor]], scheme: QuantizationConfig, report: LoadReport
) -> Iterator[tuple[str, CheckpointTensor]]:
    """Pass float tensors through; turn each packed triple into a float ``<prefix>.weight``.

    Adds every packed prefix to ``scheme.only``. Packed tensors are read whole (small: a quarter
    or an eighth of the float bytes); the float weight is then sliced per rank as usual.
    """
    bits = 8 if scheme.method == "int8" else 4
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, part = name.rpartition(".")
        if part not in _PARTS:
            yield name, tensor
            continue
        parts = pending.setdefault(prefix, {})
        parts[part] = tensor.full()
        if len(parts) < len(_PARTS):
            continue
        del pending[prefix]
        out, columns = (int(x) for x in parts["weight_shape"].tolist())
        q = unpack(parts["weight_packed"], bits, columns).float()
        scale = parts["weight_scale"].float()
        group = columns if scale.shape[1] == 1 else scheme.group_size
        if scale.shape != (out, math.ceil(columns / group)):
            raise ConfigError(
                "model.quantization_config",
                f"{prefix}.weight_scale has shape "
                f"{tuple(scale.shape)} for a {out}x{columns} weight",
            )
        weight = (
            q * scale.repeat_interleave(group, dim=1)[:, :columns]
        )  # the last group may be short
        scheme.only.add(prefix)
        yield (
            f"{prefix}.weight",
            CheckpointTensor(f"{prefix}.weight", (out, columns), weight.__getitem__, report),
        )
    if pending:
        raise ConfigError("model.model", f"incomplete packed weights for {sorted(pending)[:4]}")
