"""The C++ CPU paged MLA decode (``mla_decode.cpp``), built on first use like the other CPU kernels.

``load()`` builds (or loads the cached build of) ``mla_decode.cpp`` and returns the
``torch.ops.gridserve_cpu_mla`` namespace, or None, logging why, when it cannot (the callers in
``gridserve.kernels.mla`` then use the torch reference). ``mla_decode`` has the reference's
signature; a call the C++ does not take (another dtype, a cache wider than the query, a tensor not
on the CPU) runs the reference.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from gridserve.kernels.cpu_ops import load_library

_SOURCE = Path(__file__).with_name("mla_decode.cpp")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CACHE_DTYPES = _DTYPES + (torch.float8_e4m3fn, torch.float8_e5m2)


@functools.lru_cache(maxsize=1)
def load():
    """The ``torch.ops.gridserve_cpu_mla`` namespace, or None (reason logged) when it cannot be built."""
    if not load_library(_SOURCE, "gridserve_cpu_mla", "C++ CPU MLA decode", "the torch reference"):
        return None
    return torch.ops.gridserve_cpu_mla


def _supported(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    return (query.device.type == "cpu" and kv_cache.device.type == "cpu" and query.dtype in _DTYPES
            and kv_cache.dtype in _CACHE_DTYPES and kv_cache.element_size() <= query.element_size()
            and query.dim() == 3 and kv_cache.dim() == 3 and kv_cache.stride(-1) == 1)


def mla_decode(query: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
               seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float,
               kv_lora_rank: int) -> torch.Tensor:
    """``gridserve.kernels.mla.reference_mla_decode`` with the cache entries read in place."""
    from gridserve.kernels import mla

    ops = load()
    if ops is None or not _supported(query, kv_cache):
        return mla.reference_mla_decode(query, kv_cache, query_start_loc, seq_lens, block_table, scale,
                                        kv_lora_rank)
    out = torch.empty(query.shape[0], query.shape[1], kv_lora_rank, dtype=query.dtype)
    query = query if query.stride(-1) == 1 else query.contiguous()
    ops.mla_decode(out, query, kv_cache, _int32(query_start_loc), _int32(seq_lens), _int32(block_table),
                   float(scale), int(kv_lora_rank))
    return out


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t.to(device="cpu", dtype=torch.int32).contiguous()
