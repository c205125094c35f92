"""Builds a model from its config and fills it with the checkpoint's weights.

The model is built on the meta device (each tensor-parallel rank builds only its shard), moved to
the device uninitialised, and filled by its ``load_weights`` from lazily read checkpoint tensors:
a sharded layer reads only its slice, and ``LoadReport`` records how much of each tensor was read.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from gridserve.services.worker.models import construct_model, get_model_class
from gridserve.shared.config import GridserveConfig
from gridserve.shared.errors import ModelNotFoundError

logger = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# ``GridserveConfig.kv_cache_dtype`` (resolved) -> the KV cache's storage dtype.
KV_CACHE_TORCH_DTYPES = {**TORCH_DTYPES, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                         "fp8_e5m2": torch.float8_e5m2}


class CheckpointTensor:
    """One checkpoint tensor, read lazily: a tensor-parallel layer reads only its rows or columns.

    Backed by a safetensors slice (``safe_open(...).get_slice``: only the requested bytes are read)
    or by an already-loaded tensor (``pytorch_model.bin``). Every read is recorded in ``report``.
    """

    def __init__(self, name: str, shape: tuple[int, ...], read: Callable[[tuple], torch.Tensor],
                 report: LoadReport) -> None:
        self.name = name
        self.shape = shape
        self._read = read
        self._report = report

    def full(self) -> torch.Tensor:
        return self._take(tuple(slice(None) for _ in self.shape))

    def rows(self, start: int, end: int) -> torch.Tensor:
        """``tensor[start:end]`` (dim 0)."""
        return self._take((slice(start, end),) + tuple(slice(None) for _ in self.shape[1:]))

    def cols(self, start: int, end: int) -> torch.Tensor:
        """``tensor[:, start:end]`` (dim 1)."""
        return self._take((slice(None), slice(start, end)))

    def narrow(self, dim: int, start: int, end: int) -> torch.Tensor:
        """``start:end`` along ``dim``, whole along the others (a TP slice of stacked expert weights)."""
        return self._take(tuple(slice(start, end) if d == dim else slice(None) for d in range(len(self.shape))))

    def _take(self, index: tuple) -> torch.Tensor:
        tensor = self._read(index)
        self._report.record(self.name, tensor.numel(), math.prod(self.shape))
        return tensor


@dataclass
class LoadReport:
    """Elements read of every checkpoint tensor: proof that a rank read only its shards."""

    read: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (elements read, total)

    def record(self, name: str, elements: int, total: int) -> None:
        done, _ = self.read.get(name, (0, total))
        self.read[name] = (done + elements, total)

    def fraction(self, name: str) -> float:
        done, total = self.read[name]
        return done / total if total else 1.0

    def max_fraction(self, names: Iterable[str]) -> float:
        return max((self.fraction(n) for n in names), default=0.0)


def iterate_weights(model_path: str | Path, report: Optional[LoadReport] = None) -> Iterator[tuple[str, CheckpointTensor]]:
    """Yield ``(name, CheckpointTensor)`` from ``*.safetensors`` (sharded or not) or ``pytorch_model*.bin``.

    A yielded tensor is readable until the next one is requested (its file stays open till then).
    """
    report = report if report is not None else LoadReport()
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
                    sliced = f.get_slice(name)
                    yield name, CheckpointTensor(name, tuple(sliced.get_shape()), sliced.__getitem__, report)
        return
    bin_files = sorted(folder.glob("pytorch_model*.bin"))
    if not bin_files:
        raise ModelNotFoundError(f"no *.safetensors or pytorch_model*.bin weights in {str(folder)!r}")
    for file in bin_files:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        for name, tensor in state.items():
            yield name, CheckpointTensor(name, tuple(tensor.shape), tensor.__getitem__, report)


def load_model(config: GridserveConfig, device: torch.device) -> nn.Module:
    """Instantiate the architecture on ``device`` without random init, then copy the weights in."""
    model_class = get_model_class(config.model.architecture)
    dtype = TORCH_DTYPES[config.model.resolved_dtype]
    with torch.device("meta"):
        model = construct_model(model_class, config)
    model = model.to_empty(device=device).to(dtype)
    report = LoadReport()
    weights = iterate_weights(config.model.model_path, report)
    prequantized = None
    if config.model.quantization == "compressed-tensors":
        from gridserve.services.worker.quantization import compressed_tensors

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
    from gridserve.services.worker.quantization import QuantizedWeight

    quantized = sum(m.nbytes() for m in model.modules() if isinstance(m, QuantizedWeight))
    return sum(p.numel() * p.element_size() for p in model.parameters()) + quantized


def _quantize(model: nn.Module, config: GridserveConfig, prequantized=None) -> None:
    """Quantize this rank's shards by the per-layer config (no-op without ``quantization``), or
    re-quantize the layers a pre-quantized checkpoint stored packed (``prequantized``)."""
    from gridserve.services.worker.quantization import QuantizationConfig, quantize_model

    quant = prequantized or QuantizationConfig.from_model_config(config.model.quantization,
                                                                 config.model.quantization_config)
    if quant is not None:
        model.quantization = quantize_model(model, quant, config.model.num_layers)


def _reset_non_persistent(model: nn.Module, device: torch.device) -> None:
    """Modules built on the meta device lose plain tensors; recreate what they need."""
    from gridserve.services.worker.attention import PagedAttention

    for module in model.modules():
        if isinstance(module, PagedAttention):
            module.kv_cache = torch.empty(0, device=device)
