"""reshape_and_cache: scatter the step's packed keys and values into their paged-cache slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gridserve.kernels.triton_ops._common import fp8_max, pow2


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch,
    num_heads, k_scale, v_scale,
    PAGE: tl.constexpr, HEAD_SIZE: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_PAD: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    """One program per token: copy its [num_kv_heads, head_size] key and value into its slot.

    ``FP8_MAX > 0``: an fp8 cache, which stores ``key / k_scale`` and ``value / v_scale`` saturated
    to +-FP8_MAX."""
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token (slot -1): nothing to write
        return
    dst = (slot // PAGE) * stride_cb + (slot % PAGE) * stride_cs
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, HEAD_PAD)[None, :]
    mask = (heads < num_heads) & (dims < HEAD_SIZE)
    key = tl.load(key_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    value = tl.load(value_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    if FP8_MAX > 0:
        key = tl.clamp(key.to(tl.float32) / k_scale, -FP8_MAX, FP8_MAX)
        value = tl.clamp(value.to(tl.float32) / v_scale, -FP8_MAX, FP8_MAX)
    cache_offsets = dst + heads * stride_ch + dims
    tl.store(k_cache_ptr + cache_offsets, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_offsets, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """Write packed ``key`` / ``value`` ([num_tokens, num_kv_heads, head_size]) into their slots.

    Same contract as the reference; a negative slot (padding) is skipped.
    """
    num_tokens, num_heads, head_size = key.shape
    if num_tokens == 0:
        return
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache must be contiguous in its last (head_size) dimension")
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_heads, float(k_scale), float(v_scale),
        PAGE=kv_cache.shape[2], HEAD_SIZE=head_size,
        HEADS_PAD=pow2(num_heads), HEAD_PAD=pow2(head_size), FP8_MAX=fp8_max(kv_cache.dtype),
    )
