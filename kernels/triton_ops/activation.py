"""silu_and_mul: the SwiGLU activation over a merged gate/up projection."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gridserve.kernels.triton_ops._common import pow2, rows_of

MAX_BLOCK = 1024


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


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for a merged gate/up projection of width ``2 * d``."""
    d = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype, device=x.device)
    rows = rows_of(x)
    if rows.shape[0] == 0 or d == 0:
        return out
    out2d = out.view(-1, d)
    block = min(pow2(d), MAX_BLOCK)
    grid = (rows.shape[0], triton.cdiv(d, block))
    _silu_and_mul_kernel[grid](rows, out2d, rows.stride(0), out2d.stride(0), d, BLOCK=block)
    return out
