"""``LoRAManager``: the worker's adapters — loaded ones in a CPU LRU, the step's ones in device slots.

The engine names each request's adapter (``LoRARequest``: name, id, folder) and keeps at most
``max_loras`` distinct adapters in one step. The worker reads an adapter the first time it is
needed (``add``: a new request on it, or the engine's ``add_lora``) and keeps at most
``max_cpu_loras`` of them, least recently used evicted first. Before each forward, ``set_step``
puts the step's adapters into the layers' ``max_loras`` slots — copying only those not already in
one, evicting the slot least recently used by earlier steps — and tells every layer each token's
slot. Ids are never reused by the engine, so a slot stays valid for its adapter while it holds it.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import Optional

import torch
from torch import nn

from gridserve.kernels.lora import slot_groups
from gridserve.services.worker.lora.adapter import LoRAAdapter, LoRATargets, load_adapter
from gridserve.services.worker.lora.layers import LoRALayer, LoRAStep, attach
from gridserve.shared.config import LoRAConfig
from gridserve.shared.errors import ConfigError
from gridserve.shared.lora import LoRARequest

logger = logging.getLogger(__name__)


class LoRAManager:
    """The adapters of one worker's model (this rank's slices)."""

    def __init__(self, model: nn.Module, config: LoRAConfig, device: torch.device, dtype: torch.dtype) -> None:
        if getattr(model, "weight_map", None) is None or hasattr(model, "encode_images"):
            raise ConfigError("lora.enable_lora", f"LoRA is not supported for {type(model).__name__}")
        self.config = config
        self.device = device
        self.dtype = dtype
        self.step = LoRAStep()
        self.layers: dict[str, LoRALayer] = attach(model, self.step, config.max_loras, config.max_lora_rank,
                                                   device, dtype)
        self.targets = LoRATargets.of(model, self.layers)
        self.loaded: OrderedDict[int, LoRAAdapter] = OrderedDict()  # least recently used first
        self.slots: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, least recently used first

    # ---- the adapter table ---------------------------------------------------------------
    def add(self, request: LoRARequest) -> LoRAAdapter:
        """``request``'s adapter, read from its folder unless loaded (``InvalidArgumentError`` naming
        the field when it cannot be served; nothing is kept then)."""
        adapter = self.loaded.get(request.lora_int_id)
        if adapter is not None:
            self.loaded.move_to_end(request.lora_int_id)
            return adapter
        with torch.no_grad():
            adapter = load_adapter(request, self.targets, self.config.max_lora_rank, self.dtype)
        self.loaded[request.lora_int_id] = adapter
        while len(self.loaded) > self.config.cpu_loras:
            evicted, _ = self.loaded.popitem(last=False)
            logger.info("LoRA adapter %d evicted from the worker's cache", evicted)
        logger.info("LoRA adapter %s (id %d) loaded from %s: %d layers", request.lora_name, request.lora_int_id,
                    request.lora_path, len(adapter.weights))
        return adapter

    def remove(self, lora_int_id: int) -> bool:
        """Forget adapter ``lora_int_id`` (and free its slot); False when it was not loaded."""
        self.slots.pop(lora_int_id, None)
        return self.loaded.pop(lora_int_id, None) is not None

    def list(self) -> list[int]:
        """The loaded adapters' ids, least recently used first."""
        return list(self.loaded)

    # ---- one step ------------------------------------------------------------------------
    def set_step(self, requests: Sequence[Optional[LoRARequest]], num_tokens: Sequence[int]) -> None:
        """Each request's adapter (None: the base model) and its token count this step, in batch order."""
        if all(r is None for r in requests):
            self.step.token_slots = self.step.groups = None
            return
        needed = {r.lora_int_id for r in requests if r is not None}
        for lora_id in needed & set(self.loaded):  # used now: the last to evict when one is read below
            self.loaded.move_to_end(lora_id)
        per_request = [-1 if r is None else self._slot(r, needed) for r in requests]
        slots = torch.repeat_interleave(torch.tensor(per_request, dtype=torch.int64),
                                        torch.tensor(num_tokens, dtype=torch.int64))
        self.step.groups = slot_groups(slots) if self.device.type == "cpu" else None
        self.step.token_slots = slots.to(self.device, non_blocking=True)

    def _slot(self, request: LoRARequest, needed: set[int]) -> int:
        """The device slot holding ``request``'s adapter, copied in when it holds none."""
        lora_id = request.lora_int_id
        if lora_id in self.slots:
            self.slots.move_to_end(lora_id)
            return self.slots[lora_id]
        adapter = self.add(request)
        free = sorted(set(range(self.config.max_loras)) - set(self.slots.values()))
        if free:
            slot = free[0]
        else:
            victim = next((i for i in self.slots if i not in needed), None)
            if victim is None:
                raise RuntimeError(f"a step needs more than max_loras={self.config.max_loras} adapters")
            slot = self.slots.pop(victim)
        for name, layer in self.layers.items():
            layer.write(slot, adapter.weights.get(name))
        self.slots[lora_id] = slot
        return slot
