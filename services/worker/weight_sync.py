"""``WeightSyncExtension``: RLHF weight sync, a worker extension (``--worker-extension-cls``).

A trainer puts the engine to sleep (level 1), wakes the weights (``wake_up(["weights"])``), sends
new tensors by their Hugging Face names through ``collective_rpc("update_weights", ...)``, then
wakes the KV cache. Each rank copies in its own shard (the model's ``load_weights``: TP slices,
its pipeline stage), in place, so nothing is reallocated. One call is one gRPC message (64 MiB at
most): send a large model in several calls, a subset of the tensors each.
"""

from __future__ import annotations

import torch

from gridserve.services.worker import cpu_packed_linear
from gridserve.services.worker.checkpoint import CheckpointTensor, LoadReport
from gridserve.shared.errors import FailedPreconditionError, InvalidArgumentError


class WeightSyncExtension:
    """Methods mixed into the worker (``self.runner``: its ``ModelRunner``)."""

    def update_weights(self, weights: dict[str, torch.Tensor]) -> int:
        """Copy ``weights`` (HF name -> full tensor) into the model; the number this rank took."""
        model = self.runner.model
        if next(model.parameters()).is_meta:
            raise FailedPreconditionError("the weights are asleep: wake_up(['weights']) first")
        if not isinstance(weights, dict) or not all(isinstance(t, torch.Tensor) for t in weights.values()):
            raise InvalidArgumentError("weights", "must map weight names to tensors")
        report = LoadReport()
        items = ((name, CheckpointTensor(name, tuple(t.shape), t.__getitem__, report))
                 for name, t in weights.items())
        try:
            with torch.no_grad():
                loaded = model.load_weights(items)
                cpu_packed_linear.repack(model)
        except KeyError as exc:
            raise InvalidArgumentError("weights", str(exc)) from None
        return len(loaded)

    def weight_names(self) -> list[str]:
        """This rank's parameter names."""
        return [name for name, _ in self.runner.model.named_parameters()]
