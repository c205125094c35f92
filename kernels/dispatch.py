"""Picks the Triton kernel when the tensors are on CUDA and Triton imports, the reference otherwise."""

from __future__ import annotations

import functools
import logging
import os

import torch

from gridserve.kernels import reference

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def _triton_ops():
    """The Triton implementations, or None when Triton (or its kernels) cannot be imported."""
    try:
        from gridserve.kernels import triton_ops
    except ImportError as exc:
        logger.info("Triton kernels unavailable (%s); using torch reference kernels", exc)
        return None
    return triton_ops


def _impl(name: str, tensor: torch.Tensor):
    mode = os.environ.get("GRIDSERVE_KERNELS", "auto")
    if mode != "reference" and (tensor.is_cuda or mode == "triton"):
        ops = _triton_ops()
        fn = getattr(ops, name, None) if ops is not None else None
        if fn is not None:
            return fn
        if mode == "triton":
            raise RuntimeError(f"GRIDSERVE_KERNELS=triton but no Triton kernel for {name!r}")
    return getattr(reference, name)


def reshape_and_cache(key, value, kv_cache, slot_mapping) -> None:
    return _impl("reshape_and_cache", key)(key, value, kv_cache, slot_mapping)


def paged_attention(query, kv_cache, query_start_loc, seq_lens, block_table, scale, max_query_len=None):
    return _impl("paged_attention", query)(
        query, kv_cache, query_start_loc, seq_lens, block_table, scale, max_query_len
    )


def rms_norm(x, weight, eps):
    return _impl("rms_norm", x)(x, weight, eps)


def fused_add_rms_norm(x, residual, weight, eps):
    return _impl("fused_add_rms_norm", x)(x, residual, weight, eps)


def rotary_embedding(positions, query, key, cos_sin_cache, is_neox=True):
    return _impl("rotary_embedding", query)(positions, query, key, cos_sin_cache, is_neox)


def silu_and_mul(x):
    return _impl("silu_and_mul", x)(x)
