"""Multi-LoRA serving in the worker (the punica / S-LoRA approach): many PEFT adapters of the base
model, loaded at run time, applied to one batch that mixes them and the base model.

- ``adapter``: reads a PEFT folder onto the model's layers (this rank's slices), refusing what
  cannot be served with an error naming the field.
- ``layers``: each column- / row-parallel linear's slots (stacked A and B of ``max_loras``
  adapters) and the step's per-token slot, applied after the base GEMM (``kernels/lora.py``).
- ``manager``: the LRU of loaded adapters and the step's adapters put into slots.

The model runner owns one ``LoRAManager`` when ``lora.enable_lora`` is set; without it no layer
has an attachment and nothing here runs.
"""

from __future__ import annotations

from gridserve.services.worker.lora.adapter import LoRAAdapter, load_adapter
from gridserve.services.worker.lora.layers import LoRALayer, LoRAStep
from gridserve.services.worker.lora.manager import LoRAManager

__all__ = ["LoRAAdapter", "LoRALayer", "LoRAManager", "LoRAStep", "load_adapter"]
