"""One weight loader for every model: a declarative ``WeightMap`` from checkpoint names to parameters.

A model declares how its checkpoint's tensor names map onto its own parameters (renames, stacked
projections merged into one GEMM, projections the checkpoint holds pre-fused, transposed Conv1D
matrices, tensors with no parameter, per-tensor rearrangements); ``load_weights`` walks the
checkpoint once and hands each tensor to the module that owns the target parameter. A sharded
module (``ColumnParallelLinear``, ``RowParallelLinear``, ``VocabParallelEmbedding``) has a
``load(param, tensor, shard_id)`` that reads only this rank's rows or columns; anything else is
copied whole. Tensor-parallel sharding and quantization at load (which runs after) work the same for
every model because they happen below this map.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from gridserve.services.worker.checkpoint import CheckpointTensor
from gridserve.services.worker.parallel_layers import load_replicated

# A rearrangement of one whole checkpoint tensor (e.g. per-head interleaved Q/K/V -> [Q; K; V]).
Convert = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class WeightMap:
    """How a checkpoint's tensor names become this model's parameter names.

    Applied in this order to each checkpoint tensor:

    - ``skip``: regexes (``re.search``) of tensors that have no parameter (rotary ``inv_freq``,
      causal-mask buffers); they are not read.
    - ``rename``: ``(regex, replacement)`` pairs applied in turn with ``re.sub``
      (``r"^transformer\\.h\\."`` -> ``"model.layers."``).
    - ``convert``: ``(regex, fn)``: the whole tensor is read and rearranged by ``fn`` before it is
      placed (a fused projection whose rows interleave Q, K and V per head).
    - ``transposed``: regexes of 2-D tensors stored ``(in, out)`` (GPT-2's Conv1D).
    - ``stacked``: ``(fragment, merged, shard)``: a tensor whose name holds ``.fragment.`` goes into
      shard ``shard`` of the merged parameter ``.merged.`` (``q_proj`` -> shard 0 of ``qkv_proj``).
    - ``fused``: merged module names (``"qkv_proj"``) the checkpoint already holds concatenated:
      the tensor's rows are split across the module's shards by their full (unsharded) sizes, so
      each tensor-parallel rank still reads only its own rows.
    """

    skip: tuple[str, ...] = ()
    rename: tuple[tuple[str, str], ...] = ()
    convert: tuple[tuple[str, Convert], ...] = ()
    transposed: tuple[str, ...] = ()
    stacked: tuple[tuple[str, str, int], ...] = ()
    fused: tuple[str, ...] = ()

    def target(self, name: str) -> tuple[Optional[str], Optional[int]]:
        """``(parameter name, shard)`` for checkpoint tensor ``name``; ``(None, None)`` when skipped."""
        if any(re.search(pattern, name) for pattern in self.skip):
            return None, None
        for pattern, replacement in self.rename:
            name = re.sub(pattern, replacement, name)
        for fragment, merged, shard in self.stacked:
            if f".{fragment}." in name:
                return name.replace(f".{fragment}.", f".{merged}.", 1), shard
        return name, None


# The Llama-style merged projections: Q/K/V into ``qkv_proj``, gate/up into ``gate_up_proj``.
LLAMA_STACKED = (
    ("q_proj", "qkv_proj", 0),
    ("k_proj", "qkv_proj", 1),
    ("v_proj", "qkv_proj", 2),
    ("gate_proj", "gate_up_proj", 0),
    ("up_proj", "gate_up_proj", 1),
)
ROTARY_BUFFERS = (r"rotary_emb\.inv_freq$", r"\.attn\.(masked_)?bias$")


def load_weights(model: nn.Module, weights: Iterable[tuple[str, CheckpointTensor]], weight_map: WeightMap,
                 place: Optional[Callable[[str], Optional[str]]] = None) -> set[str]:
    """Copy this rank's part of each checkpoint tensor into ``model``; return the parameters loaded.

    ``place(name)`` (after ``weight_map``'s renames) may redirect a tensor to another parameter or
    return None to leave it unread: a layer of another pipeline stage, a head tied to the embedding.
    A tensor with no place in the model is an error naming it.
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        target, shard = weight_map.target(name)
        if target is None:
            continue
        if place is not None:
            placed = place(target)
            if placed is None:
                continue
            if placed != target:
                target, shard = weight_map.target(placed) if shard is None else (placed, shard)
        if target not in params:
            raise KeyError(f"checkpoint tensor {name!r} has no place in {type(model).__name__} (looked for {target!r})")
        tensor = _prepared(name, tensor, weight_map)
        module_name, _, param_name = target.rpartition(".")
        module = model.get_submodule(module_name)
        if shard is None and module_name.rpartition(".")[2] in weight_map.fused and hasattr(module, "shards"):
            _load_fused(module, param_name, tensor)
        elif hasattr(module, "load"):
            module.load(param_name, tensor, shard or 0)
        else:
            load_replicated(params[target], tensor)
        loaded.add(target)
    return loaded


def _prepared(name: str, tensor: CheckpointTensor, weight_map: WeightMap) -> CheckpointTensor:
    for pattern, fn in weight_map.convert:
        if re.search(pattern, name):
            tensor = tensor.materialized(fn(tensor.full()))
    if any(re.search(pattern, name) for pattern in weight_map.transposed) and len(tensor.shape) == 2:
        tensor = tensor.transposed()
    return tensor


def _load_fused(module: nn.Module, param: str, tensor: CheckpointTensor) -> None:
    """Split a pre-fused tensor's rows across the merged module's shards (by their full sizes)."""
    totals = [s.total for s in module.shards]
    if tensor.shape[0] != sum(totals):
        raise ValueError(f"checkpoint tensor {tensor.name!r} has {tensor.shape[0]} rows; "
                         f"{module.prefix or type(module).__name__} expects {sum(totals)} ({' + '.join(map(str, totals))})")
    offset = 0
    for shard_id, total in enumerate(totals):
        module.load(param, tensor.row_block(offset, offset + total), shard_id)
        offset += total
