"""Gated activations over a merged gate/up projection: ``silu_and_mul`` (SwiGLU) and
``gelu_and_mul`` (GeGLU), plus a plain ``gelu``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gridserve.kernels import reference
from gridserve.kernels.triton_ops._common import pow2, rows_of

MAX_BLOCK = 1024
SQRT_HALF = tl.constexpr(0.7071067811865476)
TANH_BETA = tl.constexpr(0.7978845608028654)  # sqrt(2 / pi)
TANH_KAPPA = tl.constexpr(0.044715)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, d, BLOCK: tl.constexpr):
    """Program (row, chunk): ``silu(gate) * up`` for BLOCK columns, computed in float32."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gelu_kernel(x_ptr, out_ptr, stride_x, stride_o, d, BLOCK: tl.constexpr, TANH: tl.constexpr,
                 MUL: tl.constexpr):
    """Program (row, chunk): ``gelu(x)`` (``MUL``: ``gelu(gate)``, rounded to the output dtype as
    ``F.gelu`` stores it, times ``up``) for BLOCK columns, in float32. Exact GELU is torch's
    ``0.5 x (1 + erf(x / sqrt 2))``; the tanh form ``0.5 x (1 + tanh(u))`` is ``x / (1 + exp(-2u))``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if TANH:
        u = TANH_BETA * (x + TANH_KAPPA * (x * x * x))
        out = x / (1.0 + tl.exp(tl.minimum(-2.0 * u, 88.0)))  # 88: past it x / (1 + e) is 0 anyway
    else:
        out = 0.5 * x * (1.0 + tl.math.erf(x * SQRT_HALF))
    if MUL:
        up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
        out = out.to(out_ptr.dtype.element_ty).to(tl.float32) * up
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _launch_rows(kernel, x: torch.Tensor, d: int, **constexprs) -> torch.Tensor:
    """``kernel`` over every row of ``x`` (outputs of width ``d``), a new tensor."""
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype, device=x.device)
    rows = rows_of(x)
    if rows.shape[0] == 0 or d == 0:
        return out
    out2d = out.view(-1, d)
    block = min(pow2(d), MAX_BLOCK)
    grid = (rows.shape[0], triton.cdiv(d, block))
    kernel[grid](rows, out2d, rows.stride(0), out2d.stride(0), d, BLOCK=block, **constexprs)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for a merged gate/up projection of width ``2 * d``."""
    return _launch_rows(_silu_and_mul_kernel, x, x.shape[-1] // 2)


def gelu_and_mul(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``gelu(x[..., :d], approximate) * x[..., d:]`` (``approximate``: ``"none"`` or ``"tanh"``)."""
    reference.check_approximate(approximate)
    return _launch_rows(_gelu_kernel, x, x.shape[-1] // 2, TANH=approximate == "tanh", MUL=True)


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``F.gelu(x, approximate)`` (``approximate``: ``"none"`` or ``"tanh"``)."""
    reference.check_approximate(approximate)
    return _launch_rows(_gelu_kernel, x, x.shape[-1], TANH=approximate == "tanh", MUL=False)
