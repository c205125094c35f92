"""Small helpers the Triton wrappers share: tile sizes, compute precision, device facts."""

from __future__ import annotations

import functools

import torch
import triton


def pow2(n: int, minimum: int = 1) -> int:
    """The smallest power of two that is at least ``n`` and ``minimum`` (a Triton block size)."""
    return max(triton.next_power_of_2(max(n, 1)), minimum)


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an fp8 cache dtype, 0.0 for any other (a kernel constexpr)."""
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return float(torch.finfo(dtype).max)
    return 0.0


def compute_in_fp32(*tensors: torch.Tensor) -> bool:
    """Whether a kernel must upcast its operands to float32 before any arithmetic.

    CPU tensors mean the Triton interpreter, whose bfloat16 arithmetic is wrong; float32 operands
    must stay float32 (and use IEEE dot products, not TF32) to match the reference.
    """
    return any(not t.is_cuda or t.dtype == torch.float32 for t in tensors)


def rows_of(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a 2-D [rows, last_dim] tensor whose last dimension is contiguous (a view if possible)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.reshape(-1, x.shape[-1])


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors on ``device``: how many programs keep the GPU busy (1 on CPU)."""
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _sm_count(index)
