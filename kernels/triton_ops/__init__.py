"""Triton implementations of gridserve's kernels, with exactly the reference signatures.

Importing this package raises ImportError when Triton is missing or unusable, so that
``gridserve.kernels.dispatch`` falls back to the torch reference instead of crashing.
"""

from __future__ import annotations

try:
    import triton  # noqa: F401
    import triton.language  # noqa: F401
except ImportError:
    raise
except Exception as exc:  # a broken install must read as "no Triton", not crash the worker
    raise ImportError(f"triton is installed but cannot be imported: {exc!r}") from exc

from gridserve.kernels.triton_ops.activation import gelu, gelu_and_mul, silu_and_mul
from gridserve.kernels.triton_ops.attention import paged_attention
from gridserve.kernels.triton_ops.cache import reshape_and_cache
from gridserve.kernels.triton_ops.mla import mla_decode
from gridserve.kernels.triton_ops.moe import moe_grouped_gemm
from gridserve.kernels.triton_ops.norm import fused_add_rms_norm, rms_norm
from gridserve.kernels.triton_ops.rotary import rotary_embedding

__all__ = [
    "fused_add_rms_norm",
    "gelu",
    "gelu_and_mul",
    "mla_decode",
    "moe_grouped_gemm",
    "paged_attention",
    "reshape_and_cache",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
]
