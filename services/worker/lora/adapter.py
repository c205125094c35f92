"""Reading a PEFT LoRA adapter onto the model's own layers: this rank's slice of each A and B.

A PEFT folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` (a pickled
``adapter_model.bin`` is refused, never unpickled). Each tensor
``base_model.model.<module>.lora_A.weight`` / ``.lora_B.weight`` names a module of the Hugging Face
model; the model's ``WeightMap`` says where that module's weight lives here, as it does for the
base checkpoint: ``q_proj`` is sub-matrix 0 of ``qkv_proj``; a module the checkpoint holds
pre-fused (Phi-3's ``qkv_proj``) has its B rows split by the sub-matrices' full sizes. With tensor
parallelism a column-parallel layer takes all of A and its rows of B, a row-parallel one its
columns of A and all of B; with pipeline parallelism tensors of another stage's layers are not read.

What gridserve cannot apply exactly is refused with an ``InvalidArgumentError`` naming the
``adapter_config`` field (or ``lora_path`` for the files), before anything is kept.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from gridserve.services.worker.checkpoint import CheckpointTensor, LoadReport
from gridserve.services.worker.lora.layers import LoRALayer, structure
from gridserve.services.worker.weight_loader import WeightMap
from gridserve.shared.errors import InvalidArgumentError
from gridserve.shared.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LoRARequest

_INDEXED = re.compile(r"^.*?\.\d+(?=\.)")  # a module name up to its first index: model.layers.7
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
# adapter_config fields of PEFT features gridserve does not apply; any set value is refused
_UNSUPPORTED = ("modules_to_save", "use_dora", "lora_bias", "target_parameters", "layer_replication",
                "trainable_token_indices", "alora_invocation_tokens", "use_qalora", "use_bdlora",
                "arrow_config", "kasa_config", "velora_config", "monteclora_config")


@dataclass(frozen=True)
class LoRATargets:
    """What adapters are read onto: this rank's LoRA layers and how the model places checkpoint names."""

    layers: dict[str, LoRALayer]
    weight_map: WeightMap
    place: Optional[Callable[[str], Optional[str]]]  # None for a module of another pipeline stage
    module_names: frozenset[str]  # every module of the model, other stages' placeholders included

    @classmethod
    def of(cls, model: nn.Module, layers: dict[str, LoRALayer]) -> LoRATargets:
        return cls(layers, model.weight_map, getattr(model, "_target", None),
                   frozenset(name for name, _ in model.named_modules()))


@dataclass
class LoRAAdapter:
    """One loaded adapter: for each layer it targets on this rank, ``(a, b)`` shaped like the
    layer's slot (zero padded, scaling in ``b``), on the CPU."""

    request: LoRARequest
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    report: LoadReport = field(default_factory=LoadReport)  # how much of each tensor this rank read


@dataclass(frozen=True)
class AdapterConfig:
    """What ``adapter_config.json`` says about rank and scaling."""

    r: int
    lora_alpha: float
    use_rslora: bool = False
    rank_pattern: dict = field(default_factory=dict)
    alpha_pattern: dict = field(default_factory=dict)

    @classmethod
    def parse(cls, raw: dict[str, Any], max_rank: int) -> AdapterConfig:
        peft_type = raw.get("peft_type", "LORA")
        if peft_type != "LORA":
            raise InvalidArgumentError("adapter_config.peft_type", f"only LORA adapters are served, got {peft_type!r}")
        for name in _UNSUPPORTED:
            if raw.get(name):
                raise InvalidArgumentError(f"adapter_config.{name}", f"is not supported, got {raw[name]!r:.100}")
        if raw.get("bias", "none") != "none":
            raise InvalidArgumentError("adapter_config.bias", f"only 'none' is supported, got {raw['bias']!r}")
        config = cls(r=raw.get("r", 8), lora_alpha=raw.get("lora_alpha", 8), use_rslora=bool(raw.get("use_rslora")),
                     rank_pattern=raw.get("rank_pattern") or {}, alpha_pattern=raw.get("alpha_pattern") or {})
        for name, rank in [("r", config.r), *((f"rank_pattern.{k}", v) for k, v in config.rank_pattern.items())]:
            if not isinstance(rank, int) or isinstance(rank, bool) or not 0 < rank <= max_rank:
                raise InvalidArgumentError(f"adapter_config.{name}",
                                           f"must be a rank in [1, max_lora_rank={max_rank}], got {rank!r}")
        for name, alpha in [("lora_alpha", config.lora_alpha),
                            *((f"alpha_pattern.{k}", v) for k, v in config.alpha_pattern.items())]:
            if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
                raise InvalidArgumentError(f"adapter_config.{name}", f"must be a number, got {alpha!r}")
        return config

    def scaling(self, module: str) -> float:
        """PEFT's scale of ``module``'s delta: alpha / r (rsLoRA: alpha / sqrt(r)), per-module patterns first."""
        r = _pattern(self.rank_pattern, module, self.r)
        alpha = _pattern(self.alpha_pattern, module, self.lora_alpha)
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r


def _pattern(patterns: dict, module: str, default: Any) -> Any:
    """The value of the first pattern matching the end of ``module``'s name, as PEFT matches them."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def load_adapter(request: LoRARequest, targets: LoRATargets, max_rank: int, dtype: torch.dtype) -> LoRAAdapter:
    """Read ``request``'s folder onto this rank's LoRA layers; an ``InvalidArgumentError`` naming
    the field when it cannot be served exactly."""
    folder = Path(request.lora_path)
    if not request.lora_path or not folder.is_dir():
        raise InvalidArgumentError("lora_path", f"{request.lora_path!r} is not a folder")
    weights_file = folder / ADAPTER_WEIGHTS
    if not weights_file.is_file():
        pickled = " (adapter_model.bin is a pickle, never loaded: save with safe_serialization=True)"
        raise InvalidArgumentError("lora_path", f"no {ADAPTER_WEIGHTS} in {request.lora_path!r}"
                                   + (pickled if (folder / "adapter_model.bin").exists() else ""))
    config = AdapterConfig.parse(_read_config(folder / ADAPTER_CONFIG), max_rank)
    adapter = LoRAAdapter(request)
    placer = _Placer(adapter, targets, config, max_rank)
    try:
        with safe_open(str(weights_file), framework="pt", device="cpu") as f:
            tensors = {}
            for key in f.keys():
                sliced = f.get_slice(key)
                tensors[key] = CheckpointTensor(key, tuple(sliced.get_shape()), sliced.__getitem__, adapter.report)
            pairs, others = _pairs(tensors)
            placer.place_all(pairs)
    except InvalidArgumentError:
        raise
    except (OSError, RuntimeError, ValueError, SafetensorError) as exc:
        raise InvalidArgumentError("lora_path", f"{ADAPTER_WEIGHTS} is not readable: {exc}") from exc
    if others:  # after the pairs: a module they target may be the better error (lm_head's saved weight)
        raise InvalidArgumentError("lora_path", f"unsupported tensor {others[0]!r}: only the lora_A / lora_B "
                                   "weights of linear layers are served")
    adapter.weights = {name: (a.to(dtype), b.to(dtype)) for name, (a, b) in adapter.weights.items()}
    return adapter


def _read_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise InvalidArgumentError("lora_path", f"no {ADAPTER_CONFIG} in {str(path.parent)!r}")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidArgumentError("lora_path", f"{ADAPTER_CONFIG} is not readable JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise InvalidArgumentError("lora_path", f"{ADAPTER_CONFIG} must hold an object")
    return raw


def _pairs(tensors: dict[str, CheckpointTensor]) -> tuple[dict[str, tuple[CheckpointTensor, CheckpointTensor]],
                                                          list[str]]:
    """``module -> (A, B)`` of the file's tensors, and the names of any other tensors (refused)."""
    found: dict[str, dict[str, CheckpointTensor]] = {}
    others = []
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            if "lora_embedding_" in key:
                raise InvalidArgumentError("adapter_config.target_modules",
                                           f"{key!r}: embeddings are not LoRA targets here (linear layers only)")
            others.append(key)
            continue
        if len(tensor.shape) != 2:
            raise InvalidArgumentError("lora_path", f"{key!r} has shape {tensor.shape}, expected a matrix")
        found.setdefault(match["module"], {})[match["ab"]] = tensor
    pairs = {}
    for module, ab in found.items():
        if set(ab) != {"A", "B"}:
            raise InvalidArgumentError("lora_path", f"{module!r} has lora_{''.join(ab)} but not the other half")
        pairs[module] = (ab["A"], ab["B"])
    if not pairs:
        raise InvalidArgumentError("lora_path", f"{ADAPTER_WEIGHTS} holds no LoRA weights")
    return pairs, others


class _Placer:
    """Puts each module's ``(A, B)`` into its layer's slot layout (this rank's slice of each)."""

    def __init__(self, adapter: LoRAAdapter, targets: LoRATargets, config: AdapterConfig, max_rank: int) -> None:
        self.adapter = adapter
        self.targets = targets
        self.layers = targets.layers
        self.weight_map = targets.weight_map
        self.config = config
        self.max_rank = max_rank
        self.structures = {structure(name) for name in self.layers}

    def place_all(self, pairs: dict[str, tuple[CheckpointTensor, CheckpointTensor]]) -> None:
        for module, (a, b) in pairs.items():
            target = self._layer_of(module)
            if target is None:
                continue  # a layer of another pipeline stage
            name, shard = target
            self._place(module, self.layers[name], name, shard, a, b)

    def _layer_of(self, module: str) -> Optional[tuple[str, Optional[int]]]:
        """``(layer name, sub-matrix)`` of HF module ``module``; None when another stage holds it.
        The check is by the layer's structure, so every pipeline stage refuses the same adapters."""
        wanted = f"{module}.weight"
        target, shard = self.weight_map.target(wanted)
        if target is None or not target.endswith(".weight") or any(
                re.search(p, wanted) for p, _ in self.weight_map.convert):
            raise InvalidArgumentError("adapter_config.target_modules",
                                       f"{module!r} is not a layer gridserve applies LoRA to")
        name = target[: -len(".weight")]
        if structure(name) not in self.structures:
            leaf = module.rpartition(".")[2]
            raise InvalidArgumentError("adapter_config.target_modules",
                                       f"{leaf!r} ({module}) is not a linear layer of this model that LoRA can "
                                       "target (attention and MLP projections; not embeddings, the LM head "
                                       "or MoE experts)")
        indexed = _INDEXED.match(name)  # its layer must exist, here or as another stage's placeholder
        if indexed is not None and indexed.group() not in self.targets.module_names:
            raise InvalidArgumentError("adapter_config.target_modules", f"{module!r}: the model has no {indexed.group()}")
        if self.targets.place is not None and self.targets.place(target) is None:
            return None
        if name not in self.layers:
            raise InvalidArgumentError("adapter_config.target_modules", f"{module!r}: the model has no such layer")
        return name, shard

    def _place(self, module: str, layer: LoRALayer, name: str, shard: Optional[int],
               a: CheckpointTensor, b: CheckpointTensor) -> None:
        r = a.shape[0]
        if r > self.max_rank:
            raise InvalidArgumentError("adapter_config.r", f"{module!r} has rank {r}, above max_lora_rank={self.max_rank}")
        if b.shape[1] != r:
            raise InvalidArgumentError("lora_path", f"{module!r}: lora_A has rank {r}, lora_B {b.shape[1]}")
        base = layer.base
        full_in = base.input_size if layer.is_column else base.shard.total
        if a.shape[1] != full_in:
            raise InvalidArgumentError("lora_path", f"{module!r}: lora_A takes {a.shape[1]} inputs, the model's "
                                       f"layer {full_in} (an adapter of another base model?)")
        if name not in self.adapter.weights:
            self.adapter.weights[name] = (torch.zeros(layer.lora_a.shape[1:]), torch.zeros(layer.lora_b.shape[1:]))
        slot_a, slot_b = self.adapter.weights[name]
        scale = self.config.scaling(module)
        if not layer.is_column:
            _check_rows(module, b, base.output_size)
            slot_a[:r] = a.cols(base.shard.start, base.shard.end)
            slot_b[:, :r] = b.full() * scale
            return
        sizes = base.output_sizes
        fused = shard is None and len(base.shards) > 1
        if fused and name.rpartition(".")[2] not in self.weight_map.fused:
            raise InvalidArgumentError("adapter_config.target_modules", f"{module!r} maps onto the merged layer "
                                       f"{name!r} without naming its part")
        parts = range(len(base.shards)) if fused else [shard or 0]
        block = 0 if fused else (shard or 0)
        slot_a[block * self.max_rank: block * self.max_rank + r] = a.full()
        totals = [base.shards[i].total for i in parts]
        _check_rows(module, b, sum(totals))
        offset = 0
        for i, total in zip(parts, totals):
            rows = base.shards[i]
            local = sum(sizes[:i])
            part = b.row_block(offset, offset + total) if fused else b
            slot_b[local: local + sizes[i], block * self.max_rank: block * self.max_rank + r] = (
                part.rows(rows.start, rows.end) * scale)
            offset += total


def _check_rows(module: str, b: CheckpointTensor, expected: int) -> None:
    if b.shape[0] != expected:
        raise InvalidArgumentError("lora_path", f"{module!r}: lora_B has {b.shape[0]} outputs, the model's layer "
                                   f"{expected} (an adapter of another base model?)")
