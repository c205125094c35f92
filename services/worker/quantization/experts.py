"""Quantized MoE experts: one projection of every expert a ``FusedMoE`` holds, each expert's matrix
a dense layer's ``QuantizedWeight``, run as a grouped GEMM over rows sorted by expert.

``QuantizedExperts.from_float(stacked)`` quantizes a stacked ``[E, out, in]`` projection expert by
expert with ``quantize_weight``: int8 is the dense path's scheme (symmetric, one scale per output
row of each expert) and its matmul is the dense path's too, chosen at run time (on CPU the C++
int8 x int16 GEMM of ``kernels/cpu_ops/int8_gemm.cpp`` over each expert's slice of rows, oneDNN's
int8 matmul where AMX is there, ``torch._int_mm`` without the kernel; weight-only dequantization on
CUDA or with ``weight_only``). int4 works the same way (dequantized per call: slow, as dense).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from gridserve.services.worker.quantization.weights import QuantizedWeight, quantize_weight


class QuantizedExperts(nn.Module):
    """Every expert's ``[out, in]`` matrix of one projection, quantized (``weights[e]``)."""

    def __init__(self, weights: list[QuantizedWeight]) -> None:
        super().__init__()
        if not weights:
            raise ValueError("QuantizedExperts needs at least one expert")
        self.weights = nn.ModuleList(weights)
        self.method = weights[0].method

    @classmethod
    def from_float(cls, stacked: torch.Tensor, method: str, group_size: int = 128, activations: bool = True,
                   activation_rows: int = 2, activation_group: int = 0) -> QuantizedExperts:
        """``stacked`` [E, out, in] quantized by ``method``, one expert at a time."""
        weights = [quantize_weight(w, method, group_size, activations, activation_rows, activation_group)
                   for w in stacked]
        if any(w is None for w in weights):
            raise ValueError(f"unknown quantization method {method!r}")
        return cls(weights)

    def __len__(self) -> int:
        return len(self.weights)

    def grouped_mm(self, rows: torch.Tensor, bias: Optional[torch.Tensor], counts: list[int],
                   out_features: int) -> torch.Tensor:
        """``rows`` grouped by expert (``counts[e]`` rows each, in order) times their expert's
        matrix transposed (plus ``bias[e]``): one quantized GEMM per expert with rows, each writing
        its rows of one float32 output (the integer GEMMs take and give float32), cast back once."""
        a = rows.float()
        out = torch.empty(a.shape[0], out_features, device=a.device)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            end = start + count
            self.weights[expert].matmul_into(out[start:end], a[start:end], None if bias is None else bias[expert])
            start = end
        return out.to(rows.dtype)

    def dequantize(self) -> torch.Tensor:
        """The float32 ``[E, out, in]`` these values stand for (for tests and checks)."""
        return torch.stack([w.dequantize() for w in self.weights])

    def nbytes(self) -> int:
        """Bytes held: every expert's quantized values and scales (packed layouts included)."""
        return sum(w.nbytes() for w in self.weights)
