"""Quantized linear weights: how each is stored and the matmul that reads it.

A ``QuantizedWeight`` replaces a linear layer's fp32 weight ``W`` [out, in] and computes
``x @ W.T`` from its packed form:

- ``Int8Weight``: int8 values with one scale per output channel (``W ~ q * s[:, None]``). On CPU
  the matmul quantizes the activations too, to keep the int8 weights in an integer GEMM:
  - ``activation_rows=2`` (default), 16-bit activations: the C++ int8 x int16 GEMM
    (``kernels/cpu_ops/int8_gemm.cpp``; each row to int16 with one scale, ~256x finer than int8,
    so only the weights' rounding is left: the error of weight-only int8). The weight is packed
    once, here, into the kernel's layout. Without the kernel (no compiler): each activation row
    as two int8 rows, its int8 rounding and the int8 rounding of the remainder (~15 bits), in one
    ``torch._int_mm`` of twice the rows. Measured on the trained demo model: mean KL 2e-5 and 94%
    free-running greedy agreement with fp32, as weight-only.
  - ``activation_rows=1``: one int8 row per activation, ``torch._int_mm``: 74% greedy agreement
    (mean KL 1e-4) on the demo model, under the bar.
  - ``activation_group=32`` (on request): int8 activations with one scale per 32 input columns of
    a row (llama.cpp q8_0's activation scheme) through the same C++ GEMM and packed weight, one
    ``vpdpbusd`` per 4 MACs (half the int16 mode's instructions). Demo model: mean KL 4e-5 (int16:
    2e-5); free-running greedy agreement 0.976 alone but 0.844 with a bf16 KV cache, under the bar
    (over 96 prompts 0.85 against int16's 0.89). Without the kernel: the two-int8-row path.
  fbgemm's dynamic linear (one 7-bit activation scale per call) was rejected earlier: KL 0.22.
  On CUDA, and with ``activations=False`` (``"weight_only": true``, compressed-tensors W8A16
  checkpoints), the weight is dequantized per call.
- ``Int4Weight``: 4-bit values in [-8, 7], two per byte, one scale per group of ``group_size``
  input columns. Correct everywhere, fast nowhere yet: it dequantizes to the activation dtype and
  runs ``F.linear`` (the slow path; torch's CPU int4 packs are 40-75x slower than fp32 here).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from gridserve.kernels.cpu_ops import int8_gemm

logger = logging.getLogger(__name__)


class QuantizedWeight(nn.Module, ABC):
    """A weight held quantized; ``forward(x)`` is ``x @ W.T`` (no bias: layers add it)."""

    method: str = ""

    @abstractmethod
    def forward(self, x: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def dequantize(self) -> torch.Tensor:
        """The float32 weight these values stand for (for tests and checks)."""

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def matmul_into(self, out: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> None:
        """``out = x @ W.T (+ bias)``: ``out`` a slice of a larger output (a MoE layer's expert rows)."""
        y = self(x)
        out.copy_(y if bias is None else y + bias)


class Int8Weight(QuantizedWeight):
    """int8 per-output-channel weight; on CPU an integer GEMM over quantized activations (int16
    through the C++ kernel, or int8 rows through ``torch._int_mm``), weight-only on CUDA."""

    method = "int8"

    def __init__(
        self, qweight: torch.Tensor, scales: torch.Tensor, activations: bool = True,
        activation_rows: int = 2, activation_group: int = 0,
    ) -> None:
        super().__init__()
        self.activations = activations  # quantize activation rows too (the fast CPU path)
        self.activation_rows = activation_rows  # per-row activations: 2: 16-bit; 1: int8
        self.activation_group = activation_group  # 32: int8 per 32 columns (the kernel); 0: per row
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("scales", scales.float().contiguous())  # [out]
        # The C++ int8 x int16 GEMM holds the weight in its own layout (and only there). On a CPU
        # with AMX the int16 mode runs through oneDNN's int8 matmul instead, which holds the weight
        # in its layout (and only there; ``onednn_weight``, an opaque tensor, not a buffer).
        integer_gemm = (
            activations and (activation_group or activation_rows == 2) and qweight.device.type == "cpu"
            and int8_gemm.load() is not None
        )
        self.onednn = bool(integer_gemm and not activation_group and int8_gemm.onednn_available())
        self.kernel = bool(integer_gemm and not self.onednn)
        self.onednn_weight: Optional[torch.Tensor] = None
        if self.onednn:
            self.onednn_weight = int8_gemm.onednn_pack(qweight)
        elif self.kernel:
            self.register_buffer("packed", int8_gemm.pack(qweight))
        else:
            self.register_buffer("values", qweight.contiguous())  # [out, in] int8

    def _apply(self, fn, recurse=True):
        """``.to`` / ``.cuda``: a packed weight moved off the CPU goes back to plain int8 rows (the
        kernel's layout has no reader there; CUDA dequantizes per call)."""
        super()._apply(fn, recurse)
        if self.onednn and fn(torch.empty(0, dtype=torch.int8)).device.type != "cpu":
            values = fn(self.qweight)  # e.g. meta for sleep level 2: the packed copy is freed
            self.onednn, self.onednn_weight = False, None
            self.register_buffer("values", values)
        if self.kernel and self.packed.device.type != "cpu":
            values = int8_gemm.unpack(self.packed, self.out_features, self.in_features)
            del self._buffers["packed"]
            self.kernel = False
            self.register_buffer("values", values)
        return self

    def nbytes(self) -> int:
        packed = self.onednn_weight  # an opaque oneDNN tensor, not a buffer
        return super().nbytes() + (packed.numel() * packed.element_size() if packed is not None else 0)

    @property
    def qweight(self) -> torch.Tensor:
        """The int8 values [out, in]."""
        if self.onednn:
            return self.onednn_weight.to_dense().t().contiguous()
        if self.kernel:
            return int8_gemm.unpack(self.packed, self.out_features, self.in_features)
        return self.values

    @classmethod
    def from_float(cls, weight: torch.Tensor, activations: bool = True,
                   activation_rows: int = 2,
                   activation_group: int = 0) -> Int8Weight:
        w = weight.float()
        scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(q, scales, activations, activation_rows, activation_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if (self.onednn or self.kernel) and x.device.type == "cpu":
            rows = x.reshape(-1, shape[-1]).float()
            if self.onednn:
                y = int8_gemm.onednn_gemm(rows, self.onednn_weight, self.scales, self.out_features)
            else:
                y = int8_gemm.gemm(rows, self.packed, self.scales, self.out_features,
                                   activation_group=self.activation_group)
            return y.to(x.dtype).reshape(*shape[:-1], -1)
        if (
            self.values.device.type != "cpu" or not self.activations
        ):  # weight-only, dequantized per call
            return F.linear(x, self.values.to(x.dtype) * self.scales[:, None].to(x.dtype))
        rows = x.reshape(-1, shape[-1]).float()
        n = rows.shape[0]
        high, high_scales = _int8_rows(rows)
        if self.activation_rows == 1 and not self.activation_group:
            acc = torch._int_mm(high, self.values.t())
            return (acc.float() * high_scales * self.scales).to(x.dtype).reshape(*shape[:-1], -1)
        # No kernel: each activation row as two int8 rows, its int8 rounding and the int8
        # rounding of what that left over (~15 bits), through one int8 GEMM of 2n rows (the
        # weight is read once, as at n rows).
        low, low_scales = _int8_rows(rows - high.float() * high_scales)
        acc = torch._int_mm(torch.cat((high, low)), self.values.t())  # [2n, out] int32
        y = (acc[:n].float() * high_scales + acc[n:].float() * low_scales) * self.scales
        return y.to(x.dtype).reshape(*shape[:-1], -1)

    def matmul_into(self, out: torch.Tensor, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> None:
        """The C++ kernel writes float32 rows straight into ``out`` (bias added there); other paths
        as ``QuantizedWeight``'s."""
        if self.kernel and x.device.type == "cpu" and out.dtype == torch.float32 and out.is_contiguous():
            int8_gemm.gemm(x.float(), self.packed, self.scales, self.out_features,
                           None if bias is None else bias.float(), activation_group=self.activation_group, out=out)
            return
        super().matmul_into(out, x, bias)

    def dequantize(self) -> torch.Tensor:
        return self.qweight.float() * self.scales[:, None]


class Int4Weight(QuantizedWeight):
    """4-bit symmetric weight, one scale per ``group_size`` input columns; two values per byte."""

    method = "int4"

    def __init__(
        self, packed: torch.Tensor, scales: torch.Tensor, in_features: int, group_size: int
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.group_size = group_size
        self.register_buffer("packed", packed.contiguous())  # [out, in / 2] uint8: low nibble first
        self.register_buffer("scales", scales.float().contiguous())  # [out, in / group_size]

    @classmethod
    def from_float(cls, weight: torch.Tensor, group_size: int = 128) -> Int4Weight:
        out, in_features = weight.shape
        group = group_size if in_features % group_size == 0 else in_features
        if in_features % 2:
            raise ValueError(f"int4 needs an even number of input features, got {in_features}")
        w = weight.float().reshape(out, in_features // group, group)
        scales = (w.abs().amax(dim=-1) / 7.0).clamp(min=1e-12)
        q = (
            torch.round(w / scales[..., None])
            .clamp_(-8, 7)
            .to(torch.int8)
            .reshape(out, in_features)
        )
        return cls(pack_int4(q), scales, in_features, group)

    @classmethod
    def from_values(cls, q: torch.Tensor, scales: torch.Tensor, group_size: int) -> Int4Weight:
        """From int values in [-8, 7] ([out, in]) and their group scales ([out, in / group])."""
        return cls(pack_int4(q.to(torch.int8)), scales, q.shape[1], group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantize().to(x.dtype))

    def values(self) -> torch.Tensor:
        return unpack_int4(self.packed, self.in_features)

    def dequantize(self) -> torch.Tensor:
        q = self.values().float()
        out = q.shape[0]
        groups = q.reshape(out, -1, self.group_size) * self.scales[..., None]
        return groups.reshape(out, self.in_features)


def _int8_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row: values [n, k] and scales [n, 1] with ``rows ~ values * scales``."""
    scales = (rows.abs().amax(dim=1, keepdim=True) / 127.0).clamp_(min=1e-12)
    return torch.round(rows / scales).to(torch.int8), scales


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int values in [-8, 7] ([out, in], in even) -> uint8 [out, in / 2], low nibble = even column."""
    u = (q.to(torch.int16) & 0xF).to(torch.uint8)
    return u[:, 0::2] | (u[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    low = (packed & 0xF).to(torch.int8)
    high = (packed >> 4).to(torch.int8)
    q = torch.stack((low, high), dim=-1).reshape(packed.shape[0], in_features)
    return torch.where(q >= 8, q - 16, q)


def quantize_weight(
    weight: torch.Tensor, method: str, group_size: int = 128, activations: bool = True,
    activation_rows: int = 2, activation_group: int = 0,
) -> Optional[QuantizedWeight]:
    """``weight`` quantized by ``method`` ("int8", "int4"); None for no quantization.

    ``activations=False`` keeps int8 weight-only (a W8A16 checkpoint's semantics)."""
    if method == "int8":
        return Int8Weight.from_float(weight, activations, activation_rows, activation_group)
    if method == "int4":
        return Int4Weight.from_float(weight, group_size)
    return None
