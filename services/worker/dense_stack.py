"""``DenseStack``: the sentence-transformers ``Dense`` modules an embedder applies to its pooled
vectors, in ``modules.json`` order (EmbeddingGemma: 768 -> 3072 -> 768), each
``activation(linear(x))``; the pooler then truncates (``dimensions``) and normalises their output.

``shared.pooling.read_dense_modules`` describes the modules; their weights live beside the
checkpoint, in each module's folder (``2_Dense/model.safetensors``: ``linear.weight``,
``linear.bias``), read by ``DenseStack.load_weights`` when the model's own ``load_weights`` runs.
The layers are small: every tensor-parallel rank holds them whole, as it holds the pooled rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch import nn

from gridserve.services.worker.parallel_layers import add_prefix
from gridserve.shared.errors import ConfigError, ModelNotFoundError
from gridserve.shared.pooling import DenseModule, read_dense_modules

# the model attribute that holds an embedder's stack (its parameters' names start with it)
ATTRIBUTE = "sentence_dense"


class DenseLayer(nn.Module):
    """One Dense module: ``activation(x @ weight.T + bias)``, replicated on every rank."""

    def __init__(self, module: DenseModule) -> None:
        super().__init__()
        self.linear = nn.Linear(module.in_features, module.out_features, bias=module.bias)
        self.activation = getattr(nn, module.activation)()
        self.weights_file = module.weights_file

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.activation(self.linear(x))


class DenseStack(nn.Module):
    """The Dense modules in order: ``[n, in_features]`` pooled rows -> ``[n, out_features]``, in
    the layers' dtype (the model's, as sentence-transformers runs them)."""

    def __init__(self, modules: Sequence[DenseModule]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DenseLayer(m) for m in modules)
        self.out_features = modules[-1].out_features
        self.read = False  # the module folders are read once; a later weight sync leaves them

    def forward(self, rows: torch.Tensor) -> torch.Tensor:
        rows = rows.to(self.layers[0].linear.weight.dtype)
        for layer in self.layers:
            rows = layer(rows)
        return rows

    @torch.no_grad()
    def load_weights(self, prefix: str) -> set[str]:
        """Copy each module folder's tensors into its layer; the parameters' names under ``prefix``
        (none once read: the checkpoint's files do not change)."""
        if self.read:
            return set()
        from safetensors import safe_open

        for layer in self.layers:
            with safe_open(str(layer.weights_file), framework="pt", device="cpu") as f:
                names = set(f.keys())
                for name, param in layer.named_parameters():
                    if name not in names:
                        raise ModelNotFoundError(f"{layer.weights_file} lacks {name!r}")
                    tensor = f.get_tensor(name)
                    if tuple(tensor.shape) != tuple(param.shape):
                        raise ModelNotFoundError(f"{layer.weights_file}: {name!r} has shape {tuple(tensor.shape)}, "
                                                 f"the module's config.json says {tuple(param.shape)}")
                    param.copy_(tensor)
        self.read = True
        return {add_prefix(prefix, name) for name, _ in self.named_parameters()}


def dense_stack(config: Any, hidden_size: int) -> Optional[DenseStack]:
    """The Dense modules of the checkpoint ``config`` (a ``GridserveConfig``) names, or None when its
    sentence-transformers files have none; the first must take the model's ``hidden_size``."""
    path = config.model.model_path
    modules = read_dense_modules(path) if path else ()
    if not modules:
        return None
    if modules[0].in_features != hidden_size:
        raise ConfigError(f"{modules[0].folder.name}/config.json in_features",
                          f"{modules[0].in_features} differs from the model's hidden size {hidden_size}")
    return DenseStack(modules)


def load_dense_weights(model: nn.Module) -> set[str]:
    """``model``'s Dense stack's weights read (``DenseStack.load_weights``); none without one."""
    stack = getattr(model, ATTRIBUTE, None)
    return set() if stack is None else stack.load_weights(ATTRIBUTE)
