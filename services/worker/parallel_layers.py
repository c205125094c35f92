"""Tensor-parallel building blocks: each rank holds a shard and reads only that shard from the checkpoint.

- ``ColumnParallelLinear``: output features split (Q/K/V heads, gate/up rows); no communication.
  Several checkpoint matrices may be merged into one GEMM (``shards``: one per sub-matrix).
- ``RowParallelLinear``: input features split (o_proj, down_proj); partial sums all-reduced, the
  bias added once after the reduction.
- ``VocabParallelEmbedding``: vocabulary rows split; out-of-shard tokens look up zeros and the
  all-reduce fills them in. ``parallel_logits`` is the LM head: local logits gathered on TP rank 0.

With one rank each is exactly ``nn.Linear`` / ``nn.Embedding`` (no collective, whole tensors read).

Column- and row-parallel layers may carry a LoRA attachment (``lora``, set by
``services/worker/lora``; None otherwise, at no cost): its ``apply(y, x)`` adds the step's adapter
deltas to the base output, for a row-parallel layer before the all-reduce (the partial deltas sum
to the whole one, as the partial products do).

Every layer carries its checkpoint ``prefix``; after loading, ``quantization.quantize_model`` may
swap a layer's float weight for a ``QuantizedWeight`` (int8 / int4) chosen by that prefix. Each
rank quantizes only the shard it holds. On the CPU, ``cpu_packed_linear.pack_model`` then holds each
remaining fp32 (or, with native bf16, bf16) weight in oneDNN's blocked layout (``pack_for_cpu``) instead of
the plain one.
"""

from __future__ import annotations

from typing import Optional, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from gridserve.services.worker import cpu_packed_linear
from gridserve.services.worker.batch_invariant import fixed_row_blocks
from gridserve.services.worker.checkpoint import CheckpointTensor
from gridserve.services.worker.parallel_state import ParallelState, get_parallel_state
from gridserve.services.worker.quantization.weights import QuantizedWeight, quantize_weight
from gridserve.shared.parallel import Shard, padded_vocab_rows, vocab_shard


class LoRAAttachment(Protocol):
    """What a linear layer calls after its base GEMM when LoRA serving is on (``lora.LoRALayer``)."""

    def apply(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``y`` plus each token's adapter delta of input ``x`` (in place where it can)."""


def add_prefix(prefix: str, name: str) -> str:
    """``prefix.name`` (or ``name`` at the top): a layer's checkpoint path."""
    return f"{prefix}.{name}" if prefix else name


class QuantizableLinear(nn.Module):
    """A layer computing ``x @ W.T`` whose ``weight`` may be replaced by a quantized one.

    ``prefix`` is the layer's checkpoint path; ``qweight`` is None until ``quantize``.
    """

    def __init__(self) -> None:
        super().__init__()
        self.prefix = ""
        self.qweight: Optional[QuantizedWeight] = None
        self.keeps_float_weight = False  # True where the float weight has another use (tied embedding)
        self.batch_invariant = False  # GEMMs on fixed row blocks (``batch_invariant.enable``)
        self.cpu_packed = False  # the float weight is held in oneDNN's layout (``pack_for_cpu``)
        self._packed_head: Optional[torch.Tensor] = None  # a tied head's packed copy (its table stays plain)

    def quantize(self, method: str, group_size: int = 128, activations: bool = True,
                 activation_rows: int = 2, activation_group: int = 0) -> None:
        """Swap the loaded float weight for its ``method`` form (call once the weight is loaded)."""
        self.qweight = quantize_weight(self._writable("weight"), method, group_size, activations,
                                       activation_rows, activation_group)
        if not self.keeps_float_weight:
            self.weight = None

    def pack_for_cpu(self) -> bool:
        """Hold the fp32 (or bf16) weight in oneDNN's blocked layout (``cpu_packed_linear``), replacing the
        plain one; False (nothing changed) for a quantized, batch-invariant or looked-up weight."""
        if (self.qweight is not None or self.batch_invariant or self.keeps_float_weight
                or not cpu_packed_linear.packable(self.weight)):
            return False
        self.weight = cpu_packed_linear.pack(self.weight.data)
        self.cpu_packed = True
        return True

    def pack_head_copy(self) -> bool:
        """For a tied LM head (the table is also the input embedding, so it stays plain for lookups):
        hold a packed copy for the logits GEMM; False when there is nothing to do."""
        if (not self.keeps_float_weight or self._packed_head is not None or self.qweight is not None
                or self.batch_invariant or not cpu_packed_linear.packable(self.weight)):
            return False
        self._packed_head = cpu_packed_linear.pack(self.weight.data).detach()
        return True

    def release_packed_copy(self) -> bool:
        """Drop a tied head's packed copy (``cpu_packed_linear.release``); ``repack`` makes it again."""
        had = self._packed_head is not None
        self._packed_head = None
        return had

    def _writable(self, param: str) -> torch.Tensor:
        """``param``'s data to load into: a packed weight turns plain again (``cpu_packed_linear.repack``)."""
        if param == "weight" and self.weight is not None and self.weight.is_mkldnn:
            self.weight = cpu_packed_linear.unpack(self.weight)
        if param == "weight":
            self._packed_head = None  # stale once the table changes; ``repack`` packs it again
        return getattr(self, param).data

    def _float_linear(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self._packed_head is not None:
            return cpu_packed_linear.linear(x, self._packed_head, bias)
        if self.weight.is_mkldnn:
            return cpu_packed_linear.linear(x, self.weight, bias)
        return F.linear(x, self.weight, bias)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` with whichever form of the weight this layer holds."""
        if self.batch_invariant:
            return fixed_row_blocks(self._matmul, x)
        return self._matmul(x)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:
            return self.qweight(x)
        return self._float_linear(x)


class ColumnParallelLinear(QuantizableLinear):
    """``y_local = x @ W[rows of this rank].T``; ``shards`` are this rank's rows of each merged matrix."""

    def __init__(self, input_size: int, shards: list[Shard], bias: bool, prefix: str = "") -> None:
        super().__init__()
        self.prefix = prefix
        self.shards = shards
        self.input_size = input_size
        self.output_sizes = [s.size for s in shards]
        out = sum(self.output_sizes)
        self.weight = nn.Parameter(torch.empty(out, input_size))
        self.bias = nn.Parameter(torch.empty(out)) if bias else None
        self.lora: Optional[LoRAAttachment] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is None and not self.batch_invariant:
            y = self._float_linear(x, self.bias)
        else:
            y = self.matmul(x)
            y = y if self.bias is None else y + self.bias
        return y if self.lora is None else self.lora.apply(y, x)

    def load(self, param: str, tensor: CheckpointTensor, shard_id: int = 0) -> None:
        """Copy this rank's rows of checkpoint matrix ``shard_id`` into its place in the merged ``param``."""
        shard = self.shards[shard_id]
        offset = sum(self.output_sizes[:shard_id])
        self._writable(param).narrow(0, offset, shard.size).copy_(tensor.rows(shard.start, shard.end))


class RowParallelLinear(QuantizableLinear):
    """``y = all_reduce(x_local @ W[:, columns of this rank].T) + b``."""

    def __init__(self, shard: Shard, output_size: int, bias: bool,
                 state: Optional[ParallelState] = None, prefix: str = "") -> None:
        super().__init__()
        self.prefix = prefix
        self.state = state or get_parallel_state()
        self.shard = shard
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, shard.size))
        self.bias = nn.Parameter(torch.empty(output_size)) if bias else None
        self.lora: Optional[LoRAAttachment] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.state.tp_size == 1 and self.qweight is None and not self.batch_invariant:
            y = self._float_linear(x, self.bias)
            return y if self.lora is None else self.lora.apply(y, x)
        y = self.matmul(x)
        if self.lora is not None:  # this rank's partial delta joins its partial sum
            y = self.lora.apply(y, x)
        if self.state.tp_size > 1:
            y = self.state.all_reduce(y)
        return y if self.bias is None else y + self.bias

    def load(self, param: str, tensor: CheckpointTensor, shard_id: int = 0) -> None:
        if param == "bias":  # replicated: every rank adds it once, after the reduction
            self.bias.data.copy_(tensor.full())
        else:
            self._writable("weight").copy_(tensor.cols(self.shard.start, self.shard.end))


class VocabParallelEmbedding(QuantizableLinear):
    """Embedding whose vocabulary rows are split; every rank holds ``ceil(V / tp)`` rows (zero padded).

    As the LM head its ``matmul`` gives this rank's logits; quantizing it keeps the float table
    when the module is also the input embedding (tied), drops it for a separate ``lm_head``.
    """

    def __init__(self, vocab_size: int, hidden_size: int, state: Optional[ParallelState] = None,
                 prefix: str = "") -> None:
        super().__init__()
        self.prefix = prefix
        self.keeps_float_weight = not prefix.endswith("lm_head")
        self.state = state or get_parallel_state()
        self.vocab_size = vocab_size
        self.shard = vocab_shard(vocab_size, self.state.tp_size, self.state.tp_rank)
        self.weight = nn.Parameter(torch.empty(padded_vocab_rows(vocab_size, self.state.tp_size), hidden_size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.state.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        mine = (input_ids >= self.shard.start) & (input_ids < self.shard.end)
        local = torch.where(mine, input_ids - self.shard.start, 0)
        out = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return self.state.all_reduce(out)

    def load(self, param: str, tensor: CheckpointTensor, shard_id: int = 0) -> None:
        rows = self.shard.size
        weight = self._writable("weight")
        weight[:rows].copy_(tensor.rows(self.shard.start, self.shard.end))
        weight[rows:].zero_()


def parallel_logits(hidden: torch.Tensor, head: VocabParallelEmbedding, vocab_size: int,
                    state: Optional[ParallelState] = None) -> Optional[torch.Tensor]:
    """LM head over a vocab-sharded ``head``: full logits on TP rank 0, ``None`` on the others."""
    state = state or get_parallel_state()
    logits = head.matmul(hidden)
    if state.tp_size == 1:
        return logits
    full = state.gather_to_first(logits)
    return None if full is None else full[..., :vocab_size]


def load_replicated(param: nn.Parameter, tensor: CheckpointTensor) -> None:
    param.data.copy_(tensor.full())
