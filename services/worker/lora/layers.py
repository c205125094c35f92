"""A linear layer's LoRA slots: the stacked adapter weights it applies after its base GEMM.

Every column- and row-parallel linear of the model gets a ``LoRALayer`` when LoRA serving is on
(``attach``), whether or not a loaded adapter targets it yet: adapters arrive at run time, and a
slot an adapter does not use in a layer holds zeros. A layer holds ``max_loras`` slots, each
``lora_a`` [R, in_local] and ``lora_b`` [out_local, R] of this rank, with ``R = max_lora_rank x``
the number of matrices merged into the layer (Q/K/V: 3). Sub-matrix ``i`` of a merged layer uses
rank block ``i`` of A and its own rows and block of B, so B is block-diagonal and one shrink plus
one expand serve Q, K and V together. The scaling is folded into B.

All layers of a model share one ``LoRAStep``: the slot of each token of the step being run (set by
the ``LoRAManager`` before the forward; None when no token runs on an adapter).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import nn

from gridserve.kernels.lora import SlotGroups, add_lora
from gridserve.services.worker.parallel_layers import ColumnParallelLinear, RowParallelLinear

LinearLayer = Union[ColumnParallelLinear, RowParallelLinear]
_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)")


@dataclass
class LoRAStep:
    """The step's adapter slot per token (int64 [T], -1: base model), or None: no adapter at all."""

    token_slots: Optional[torch.Tensor] = None
    groups: Optional[SlotGroups] = None  # the tokens grouped by slot (CPU), once for every layer


class LoRALayer:
    """The LoRA attachment of one linear layer (``parallel_layers.LoRAAttachment``)."""

    def __init__(self, base: LinearLayer, step: LoRAStep, max_loras: int, max_rank: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.base = base
        self.step = step
        self.max_rank = max_rank
        if isinstance(base, ColumnParallelLinear):
            blocks, in_local, out_local = len(base.shards), base.input_size, sum(base.output_sizes)
        else:
            blocks, in_local, out_local = 1, base.shard.size, base.output_size
        self.rank = max_rank * blocks
        self.lora_a = torch.zeros(max_loras, self.rank, in_local, device=device, dtype=dtype)
        self.lora_b = torch.zeros(max_loras, out_local, self.rank, device=device, dtype=dtype)
        # slots whose adapter targets this layer (an attention-only adapter skips the MLP's GEMMs)
        self.used = [False] * max_loras

    @property
    def is_column(self) -> bool:
        return isinstance(self.base, ColumnParallelLinear)

    def apply(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        step = self.step
        if step.token_slots is None or not any(self.used):
            return y
        groups = step.groups
        if groups is not None and not all(self.used):  # CPU: only the slots that write this layer
            groups = SlotGroups(tuple(g for g in groups.groups if self.used[g[0]]))
        add_lora(y, x, self.lora_a, self.lora_b, step.token_slots, groups)
        return y

    def write(self, slot: int, weights: Optional[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put an adapter's ``(a, b)`` for this layer into ``slot`` (None: the adapter skips it)."""
        self.used[slot] = weights is not None
        if weights is None:
            self.lora_a[slot].zero_()
            self.lora_b[slot].zero_()
        else:
            self.lora_a[slot].copy_(weights[0], non_blocking=True)
            self.lora_b[slot].copy_(weights[1], non_blocking=True)


def lora_targets(model: nn.Module) -> dict[str, LinearLayer]:
    """The layers LoRA may target, by module name: exactly the column- and row-parallel linears
    (a subclass with its own forward, such as an unreduced partial sum, does not apply LoRA)."""
    return {name: m for name, m in model.named_modules() if type(m) in (ColumnParallelLinear, RowParallelLinear)}


def attach(model: nn.Module, step: LoRAStep, max_loras: int, max_rank: int, device: torch.device,
           dtype: torch.dtype) -> dict[str, LoRALayer]:
    """Give every LoRA target of ``model`` its slots; returns them by module name."""
    layers = {}
    for name, base in lora_targets(model).items():
        base.lora = layers[name] = LoRALayer(base, step, max_loras, max_rank, device, dtype)
    return layers


def structure(name: str) -> str:
    """A module name with its indices as ``*`` (``model.layers.*.self_attn.qkv_proj``): the same on
    every pipeline stage, whichever layers it holds."""
    return _INDEX.sub("*", name)
