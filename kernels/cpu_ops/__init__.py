"""C++ CPU kernels, compiled with torch's extension builder on first use and cached.

``load()`` builds ``paged_attention.cpp`` the first time a worker runs attention on CPU (never at
import: the engine and gateway import gridserve without torch) and returns ``None``, logging why,
when it cannot (no compiler, no ninja, a build error). The build lands in torch's extensions
folder (``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``) and later processes
reuse it; editing the source rebuilds it.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from pathlib import Path

import torch

from gridserve.kernels import reference

logger = logging.getLogger(__name__)

KERNELS = frozenset({"paged_attention"})  # the ops this package implements
_SOURCE = Path(__file__).with_name("paged_attention.cpp")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CACHE_DTYPES = _DTYPES + (torch.float8_e4m3fn, torch.float8_e5m2)
# Rows with more new tokens than this go to the reference's per-sequence SDPA (tiled, GEMM-based);
# the kernel re-reads the context once per query token, which only pays for short rows.
MAX_KERNEL_QUERY_LEN = 4


@functools.lru_cache(maxsize=1)
def load():
    """The ``torch.ops.gridserve_cpu`` namespace, or None (reason logged) when it cannot be built."""
    if not _SOURCE.is_file():  # e.g. a wheel built without package data
        logger.warning("C++ CPU paged attention unavailable, using the torch reference: %s missing", _SOURCE)
        return None
    try:
        logger.info("Loading the C++ CPU paged-attention kernel (compiled on first use, then cached)")
        start = time.perf_counter()
        build_extension(_SOURCE, "gridserve_cpu_paged_attention")
    except Exception as exc:  # a missing compiler / ninja or a build error: fall back, don't crash
        logger.warning("C++ CPU paged attention unavailable, using the torch reference: %s", exc)
        return None
    logger.info("C++ CPU paged attention ready (%.1f s)", time.perf_counter() - start)
    return torch.ops.gridserve_cpu


def build_extension(source: Path, prefix: str) -> bool:
    """Load ``source``'s library (registering its ``torch.ops`` namespace): the build an earlier
    process cached for this exact source, else compiled now (``-O3 -fopenmp``; each hot loop carries
    its own target attributes). The source's hash is in the name, so checkouts with different
    sources never share a build. True when a cached build served; raises when the build fails."""
    from torch.utils import cpp_extension

    name = f"{prefix}_{hashlib.sha256(source.read_bytes()).hexdigest()[:10]}"
    if _load_built(cpp_extension, name):
        return True
    cpp_extension.load(name=name, sources=[str(source)], extra_cflags=["-O3", "-fopenmp"],
                       extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    return False


def _load_built(cpp_extension, name: str) -> bool:
    """Load the library an earlier process built for this source (same digest, same flags) without
    running the extension builder: its ninja step takes seconds, and rebuilds whenever another
    checkout of the same source built last (the build file names the source's path). A worker that
    restarts (recovery) thus loads the kernel in milliseconds. False when there is none yet."""
    try:
        library = Path(cpp_extension._get_build_directory(name, False)) / f"{name}.so"
        if not library.is_file():
            return False
        torch.ops.load_library(str(library))
    except (OSError, RuntimeError, AttributeError) as exc:  # a partial or foreign file: build it
        logger.info("cached C++ CPU kernel not usable (%s): building", exc)
        return False
    return True


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    max_query_len: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    all_rows: bool = False,
) -> torch.Tensor:
    """``reference.paged_attention`` with K/V read in place from the cache for short rows.

    Rows of up to ``MAX_KERNEL_QUERY_LEN`` new tokens (decode) run in the C++ kernel; longer
    rows (prefill, chunked prefill) in the reference's SDPA. ``all_rows`` (batch-invariant mode):
    every row in the kernel, so a token's result does not depend on its row's length (the kernel
    computes each query token alone, in one order over its positions). Needs ``load()`` to have
    succeeded.
    """
    ops = load()
    if all_rows and (ops is None or not _supported(query, kv_cache)):
        raise RuntimeError(f"batch-invariant attention: the C++ kernel does not take {query.dtype} "
                           f"queries over a {kv_cache.dtype} cache")
    if ops is None or not _supported(query, kv_cache):
        return reference.paged_attention(
            query, kv_cache, query_start_loc, seq_lens, block_table, scale, max_query_len, k_scale, v_scale
        )
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    query = query if query.stride(-1) == 1 else query.contiguous()  # other strides are read as is
    query_start_loc, seq_lens = _int32(query_start_loc), _int32(seq_lens)
    ops.paged_attention(
        out, query, kv_cache, query_start_loc, seq_lens, _int32(block_table), float(scale),
        query.shape[0] if all_rows else MAX_KERNEL_QUERY_LEN, float(k_scale), float(v_scale),
    )
    if all_rows:
        return out
    if max_query_len is None or max_query_len > MAX_KERNEL_QUERY_LEN:
        qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
        longer = [i for i in range(len(lens)) if qsl[i + 1] - qsl[i] > MAX_KERNEL_QUERY_LEN]
        reference.prefill_rows(query, kv_cache, qsl, lens, block_table, longer, scale, out, (k_scale, v_scale))
    return out


def _supported(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    return (query.dtype in _DTYPES and kv_cache.dtype in _CACHE_DTYPES
            and kv_cache.element_size() <= query.element_size() and kv_cache.stride(-1) == 1)


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int32).contiguous()
