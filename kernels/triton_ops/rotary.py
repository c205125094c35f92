"""Rotary position embedding of queries and keys from a precomputed cos/sin cache.

Scaling schemes (Llama 3, YaRN, ...) are baked into ``cos_sin_cache`` when it is built; the kernel
only looks positions up and rotates, in neox style (halves) or GPT-J style (interleaved pairs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gridserve.kernels.triton_ops._common import pow2


@triton.jit
def _rotate_heads(
    x_ptr, out_ptr, stride_xh, stride_oh, num_heads, cos, sin,
    HEAD_SIZE: tl.constexpr, ROT_HALF: tl.constexpr, HEADS_PAD: tl.constexpr,
    HALF_PAD: tl.constexpr, PASS_PAD: tl.constexpr, IS_NEOX: tl.constexpr,
):
    """Rotate every head of one token (pointers already at the token); copy the pass-through dims."""
    heads = tl.arange(0, HEADS_PAD)[:, None]
    pairs = tl.arange(0, HALF_PAD)[None, :]
    mask = (heads < num_heads) & (pairs < ROT_HALF)
    if IS_NEOX:
        first = pairs
        second = pairs + ROT_HALF
    else:
        first = 2 * pairs
        second = 2 * pairs + 1
    x1 = tl.load(x_ptr + heads * stride_xh + first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + heads * stride_xh + second, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    tl.store(out_ptr + heads * stride_oh + first, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(out_ptr + heads * stride_oh + second, (x2 * cos + x1 * sin).to(dtype), mask=mask)
    if PASS_PAD > 0:
        dims = 2 * ROT_HALF + tl.arange(0, PASS_PAD)[None, :]
        keep = (heads < num_heads) & (dims < HEAD_SIZE)
        x = tl.load(x_ptr + heads * stride_xh + dims, mask=keep)
        tl.store(out_ptr + heads * stride_oh + dims, x, mask=keep)


@triton.jit
def _rotary_kernel(
    positions_ptr, q_ptr, k_ptr, q_out_ptr, k_out_ptr, cache_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh, stride_cache,
    num_q_heads, num_k_heads,
    HEAD_SIZE: tl.constexpr, ROT_HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr, K_HEADS_PAD: tl.constexpr, PASS_PAD: tl.constexpr,
    IS_NEOX: tl.constexpr,
):
    """One program per token: look its position up once, rotate all its query and key heads."""
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    pairs = tl.arange(0, HALF_PAD)[None, :]
    in_rot = pairs < ROT_HALF
    row = cache_ptr + position * stride_cache
    cos = tl.load(row + pairs, mask=in_rot, other=0.0).to(tl.float32)
    sin = tl.load(row + ROT_HALF + pairs, mask=in_rot, other=0.0).to(tl.float32)
    _rotate_heads(
        q_ptr + token * stride_qt, q_out_ptr + token * stride_qot, stride_qh, stride_qoh,
        num_q_heads, cos, sin, HEAD_SIZE, ROT_HALF, Q_HEADS_PAD, HALF_PAD, PASS_PAD, IS_NEOX,
    )
    _rotate_heads(
        k_ptr + token * stride_kt, k_out_ptr + token * stride_kot, stride_kh, stride_koh,
        num_k_heads, cos, sin, HEAD_SIZE, ROT_HALF, K_HEADS_PAD, HALF_PAD, PASS_PAD, IS_NEOX,
    )


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``query`` / ``key`` ([num_tokens, heads, head_size]) by their positions.

    Returns new tensors, as the reference; dimensions past ``rotary_dim`` pass through unchanged.
    """
    num_tokens, num_q_heads, head_size = query.shape
    rot_half = cos_sin_cache.shape[-1] // 2
    query = query if query.stride(-1) == 1 else query.contiguous()
    key = key if key.stride(-1) == 1 else key.contiguous()
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    q_out, k_out = torch.empty_like(query), torch.empty_like(key)
    if num_tokens == 0:
        return q_out, k_out
    pass_dims = head_size - 2 * rot_half
    _rotary_kernel[(num_tokens,)](
        positions, query, key, q_out, k_out, cache,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cache.stride(0),
        num_q_heads, key.shape[1],
        HEAD_SIZE=head_size, ROT_HALF=rot_half, HALF_PAD=pow2(rot_half),
        Q_HEADS_PAD=pow2(num_q_heads), K_HEADS_PAD=pow2(key.shape[1]),
        PASS_PAD=pow2(pass_dims) if pass_dims else 0, IS_NEOX=is_neox,
    )
    return q_out, k_out
