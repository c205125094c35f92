"""Batch-invariant numerics (``--batch-invariant``): a token's logits bitwise independent of the batch.

Normally a token's logits depend, in their last bits, on which other tokens share its step and on
whether it was computed in a prefill (any chunk split) or a decode: the CPU GEMM libraries pick
their blocking by the number of rows, and attention runs prefill rows through SDPA but decode rows
through another kernel. Seeded sampling is a pure function of (seed, token index), so such a last
bit can flip a draw near a step of the CDF, and a request's tokens then depend on the batch mix.

In this mode (measured on the CPU, see docs/serving/limits.md, "Batch-invariant mode"):

- every linear layer (QKV, o_proj, gate/up, down, the LM head; column- and row-parallel shards,
  quantized or not) runs on fixed blocks of ``BLOCK_ROWS`` rows, the last one zero-padded, so the
  GEMM library sees one shape whatever the batch: a row's result is the same at any place of any
  block (checked by ``tests/unit/worker/test_batch_invariant.py``);
- attention runs every row, prefill or decode, through the C++ kernel, which computes each query
  token on its own in one fixed order over its KV positions;
- RMSNorm, RoPE, SiLU, the embedding and the sampler are already row-wise.

It needs the C++ CPU attention kernel and, as vLLM's mode, the same thread count on every worker
(the GEMM's blocking also depends on it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from gridserve.shared.errors import ConfigError

BLOCK_ROWS = 16  # rows per GEMM call; any fixed count works, 16 measured cheapest at batch 1-64


def fixed_row_blocks(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor,
                     rows: int = BLOCK_ROWS) -> torch.Tensor:
    """``fn(x)`` computed on blocks of exactly ``rows`` rows of ``x`` (``[..., features]``)."""
    lead, width = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, width)
    count = flat.shape[0]
    pad = (-count) % rows
    if pad or count == 0:
        flat = torch.cat([flat, flat.new_zeros(pad or rows, width)])
    out = torch.cat([fn(flat[i : i + rows]) for i in range(0, flat.shape[0], rows)])
    return out[:count].reshape(*lead, out.shape[-1])


def check_available(device: torch.device) -> None:
    """Refuse the mode (naming the setting) where it cannot hold: off the CPU, or without the C++
    attention kernel (built now, at load, rather than failing the first step)."""
    if device.type != "cpu":
        raise ConfigError("device.batch_invariant", f"batch-invariant mode is implemented for the CPU only, not {device}")
    from gridserve.kernels import cpu_ops

    if cpu_ops.load() is None:
        raise ConfigError("device.batch_invariant",
                          "batch-invariant mode needs the C++ CPU paged-attention kernel, which did not build (see the log)")


def enable(model: nn.Module) -> int:
    """Switch every layer of ``model`` that has a batch-invariant path to it; returns how many."""
    switched = 0
    for module in model.modules():
        if hasattr(module, "batch_invariant"):
            module.batch_invariant = True
            switched += 1
    return switched
