"""The example's models (imported only by a worker). Both reuse gridserve's Llama layers.

``ExampleLlamaForCausalLM`` has the current constructor, ``__init__(self, *, config, prefix="")``
(``config``: the engine's ``GridserveConfig``; its ``model.hf_config`` is the checkpoint's
config.json). It scales the final logits by ``logit_scale`` from config.json (1.0 when absent).
``ExampleOldStyleForCausalLM`` keeps the old positional signature ``__init__(self, config, prefix)``;
gridserve adapts it and warns once.
"""

from __future__ import annotations

from typing import Optional

import torch

from gridserve.services.worker.models.llama import LlamaForCausalLM


class ExampleLlamaForCausalLM(LlamaForCausalLM):
    """Llama with a ``logit_scale`` on the output distribution."""

    def __init__(self, *, config, prefix: str = "") -> None:
        super().__init__(config=config, prefix=prefix)
        self.logit_scale = float(config.model.hf_config.get("logit_scale", 1.0))

    def compute_logits(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        logits = super().compute_logits(hidden)
        return None if logits is None else logits * self.logit_scale


class ExampleOldStyleForCausalLM(LlamaForCausalLM):
    """A model written for the old constructor: positional ``config`` and ``prefix``."""

    def __init__(self, config, prefix: str = "") -> None:
        super().__init__(config=config, prefix=prefix)
