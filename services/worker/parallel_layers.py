"""Tensor-parallel building blocks: each rank holds a shard and reads only that shard from the checkpoint.

- ``ColumnParallelLinear``: output features split (Q/K/V heads, gate/up rows); no communication.
  Several checkpoint matrices may be merged into one GEMM (``shards``: one per sub-matrix).
- ``RowParallelLinear``: input features split (o_proj, down_proj); partial sums all-reduced, the
  bias added once after the reduction.
- ``VocabParallelEmbedding``: vocabulary rows split; out-of-shard tokens look up zeros and the
  all-reduce fills them in. ``parallel_logits`` is the LM head: local logits gathered on TP rank 0.

With one rank each is exactly ``nn.Linear`` / ``nn.Embedding`` (no collective, whole tensors read).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from gridserve.services.worker.loader import CheckpointTensor
from gridserve.services.worker.parallel_state import ParallelState, get_parallel_state
from gridserve.shared.parallel import Shard, padded_vocab_rows, vocab_shard


class ColumnParallelLinear(nn.Module):
    """``y_local = x @ W[rows of this rank].T``; ``shards`` are this rank's rows of each merged matrix."""

    def __init__(self, input_size: int, shards: list[Shard], bias: bool) -> None:
        super().__init__()
        self.shards = shards
        self.output_sizes = [s.size for s in shards]
        out = sum(self.output_sizes)
        self.weight = nn.Parameter(torch.empty(out, input_size))
        self.bias = nn.Parameter(torch.empty(out)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def load(self, param: str, tensor: CheckpointTensor, shard_id: int = 0) -> None:
        """Copy this rank's rows of checkpoint matrix ``shard_id`` into its place in the merged ``param``."""
        shard = self.shards[shard_id]
        offset = sum(self.output_sizes[:shard_id])
        getattr(self, param).data.narrow(0, offset, shard.size).copy_(tensor.rows(shard.start, shard.end))


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_local @ W[:, columns of this rank].T) + b``."""

    def __init__(self, shard: Shard, output_size: int, bias: bool,
                 state: Optional[ParallelState] = None) -> None:
        super().__init__()
        self.state = state or get_parallel_state()
        self.shard = shard
        self.weight = nn.Parameter(torch.empty(output_size, shard.size))
        self.bias = nn.Parameter(torch.empty(output_size)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.state.tp_size == 1:
            return F.linear(x, self.weight, self.bias)
        y = self.state.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias

    def load(self, param: str, tensor: CheckpointTensor, shard_id: int = 0) -> None:
        if param == "bias":  # replicated: every rank adds it once, after the reduction
            self.bias.data.copy_(tensor.full())
        else:
            self.weight.data.copy_(tensor.cols(self.shard.start, self.shard.end))


class VocabParallelEmbedding(nn.Module):
    """Embedding whose vocabulary rows are split; every rank holds ``ceil(V / tp)`` rows (zero padded)."""

    def __init__(self, vocab_size: int, hidden_size: int, state: Optional[ParallelState] = None) -> None:
        super().__init__()
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
        self.weight.data[:rows].copy_(tensor.rows(self.shard.start, self.shard.end))
        self.weight.data[rows:].zero_()


def parallel_logits(hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int,
                    state: Optional[ParallelState] = None) -> Optional[torch.Tensor]:
    """LM head over a vocab-sharded ``weight``: full logits on TP rank 0, ``None`` on the others."""
    state = state or get_parallel_state()
    logits = F.linear(hidden, weight)
    if state.tp_size == 1:
        return logits
    full = state.gather_to_first(logits)
    return None if full is None else full[..., :vocab_size]


def load_replicated(param: nn.Parameter, tensor: CheckpointTensor) -> None:
    param.data.copy_(tensor.full())
