"""Builds a model from its config and fills it with the checkpoint's weights."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from gridserve.services.worker.models import get_model_class
from gridserve.shared.config import GridserveConfig
from gridserve.shared.errors import ModelNotFoundError

logger = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def iterate_weights(model_path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` from ``*.safetensors`` (sharded or not) or ``pytorch_model*.bin``."""
    folder = Path(model_path)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        st_files = [folder / name for name in files]
    else:
        st_files = sorted(folder.glob("*.safetensors"))
    if st_files:
        from safetensors import safe_open

        for file in st_files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        return
    bin_files = sorted(folder.glob("pytorch_model*.bin"))
    if not bin_files:
        raise ModelNotFoundError(f"no *.safetensors or pytorch_model*.bin weights in {str(folder)!r}")
    for file in bin_files:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        yield from state.items()


def load_model(config: GridserveConfig, device: torch.device) -> nn.Module:
    """Instantiate the architecture on ``device`` without random init, then copy the weights in."""
    model_class = get_model_class(config.model.architecture)
    dtype = TORCH_DTYPES[config.model.resolved_dtype]
    with torch.device("meta"):
        model = model_class(config=config)
    model = model.to_empty(device=device).to(dtype)
    loaded = model.load_weights(iterate_weights(config.model.model_path))
    missing = {name for name, _ in model.named_parameters()} - loaded
    if missing:
        raise ModelNotFoundError(
            f"checkpoint {config.model.model_path!r} lacks weights for: {', '.join(sorted(missing)[:8])}"
        )
    _reset_non_persistent(model, device)
    logger.info("loaded %s (%s) on %s", config.model.architecture, config.model.resolved_dtype, device)
    return model.eval()


def _reset_non_persistent(model: nn.Module, device: torch.device) -> None:
    """Modules built on the meta device lose plain tensors; recreate what they need."""
    from gridserve.services.worker.attention import PagedAttention

    for module in model.modules():
        if isinstance(module, PagedAttention):
            module.kv_cache = torch.empty(0, device=device)
