"""C++ CPU kernels, compiled with torch's extension builder on first use and cached.

``load()`` builds ``paged_attention.cpp`` the first time a worker runs attention on CPU (never at
import: the engine and gateway import gridserve without torch) and returns ``None``, logging why,
when it cannot (no compiler, no ninja, a build error). ``load_layer_ops()`` does the same for
``layer_ops.cpp``, the per-token ops (RMSNorm, fused add + RMSNorm, rotary embedding,
SiLU-and-mul, GELU and GELU-and-mul, the KV-cache write), on their first CPU call or at ``dispatch.prepare``. The build lands in torch's extensions
folder (``TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``) and later processes
reuse it; editing the source rebuilds it. ``paged_attention_short_rows`` runs the attention kernel
on decode rows only, with gpt-oss's attention sinks; ``mla.py`` builds and wraps ``mla_decode.cpp``
(the paged MLA decode) the same way.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import time
from pathlib import Path

import torch

from gridserve.kernels import reference

logger = logging.getLogger(__name__)

# the per-token ops of layer_ops.cpp (their own library, loaded by ``load_layer_ops``)
LAYER_KERNELS = frozenset({"rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul",
                           "gelu_and_mul", "gelu", "reshape_and_cache"})
KERNELS = frozenset({"paged_attention"}) | LAYER_KERNELS  # the ops this package implements
_SOURCE = Path(__file__).with_name("paged_attention.cpp")
_LAYER_SOURCE = Path(__file__).with_name("layer_ops.cpp")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CACHE_DTYPES = _DTYPES + (torch.float8_e4m3fn, torch.float8_e5m2)
# Rows with more new tokens than this go to the reference's per-sequence SDPA (tiled, GEMM-based);
# the kernel re-reads the context once per query token, which only pays for short rows.
MAX_KERNEL_QUERY_LEN = 4


@functools.lru_cache(maxsize=1)
def load():
    """The ``torch.ops.gridserve_cpu`` namespace, or None (reason logged) when it cannot be built."""
    if not load_library(_SOURCE, "gridserve_cpu_paged_attention", "C++ CPU paged attention", "the torch reference"):
        return None
    return torch.ops.gridserve_cpu


@functools.lru_cache(maxsize=1)
def load_layer_ops():
    """The ``torch.ops.gridserve_cpu_layer`` namespace, or None (reason logged) when it cannot be built."""
    if not load_library(_LAYER_SOURCE, "gridserve_cpu_layer_ops", "C++ CPU layer ops", "the torch reference"):
        return None
    return torch.ops.gridserve_cpu_layer


def loader(name: str):
    """The loader of the library that implements op ``name`` (one of ``KERNELS``)."""
    return load_layer_ops if name in LAYER_KERNELS else load


def load_library(source: Path, prefix: str, what: str, fallback: str) -> bool:
    """``build_extension`` for a loader: False, logging "``what`` unavailable, using ``fallback``" and
    why, when the library cannot be had (the source missing, as from a wheel built without package
    data; no compiler or ninja; a build error): callers fall back, never crash."""
    if not source.is_file():
        logger.warning("%s unavailable, using %s: %s missing", what, fallback, source)
        return False
    try:
        start = time.perf_counter()
        cached = build_extension(source, prefix)
    except Exception as exc:  # a missing compiler / ninja or a build error
        logger.warning("%s unavailable, using %s: %s", what, fallback, exc)
        return False
    logger.info("%s ready (%s, %.1f s)", what, "cached build" if cached else "compiled", time.perf_counter() - start)
    return True


def build_extension(source: Path, prefix: str) -> bool:
    """Load ``source``'s library (registering its ``torch.ops`` namespace): the build an earlier
    process cached for this exact source, else compiled now (``-O3 -fopenmp``; each hot loop carries
    its own target attributes). The hash of the source and of the headers beside it (which it may
    include) is in the name, so checkouts with different sources never share a build. True when a
    cached build served; raises when the build fails."""
    from torch.utils import cpp_extension

    digest = hashlib.sha256(source.read_bytes())
    for header in sorted(source.parent.glob("*.h")):
        digest.update(header.read_bytes())
    name = f"{prefix}_{digest.hexdigest()[:10]}"
    if _load_built(cpp_extension, name):
        return True
    return _build(cpp_extension, name, source)


def _build(cpp_extension, name: str, source: Path) -> bool:
    """Compile ``source`` under an exclusive ``flock`` on ``<name>.flock`` beside its build folder.
    The kernel releases a flock when its holder dies, so a builder killed mid-build (a worker
    SIGKILLed at start) blocks nobody: torch's own ``lock`` file, which such a builder leaves and
    every later build waits on forever, is removed while the flock is held (no other process is
    building this library then). True when another process finished the build meanwhile."""
    build_dir = Path(cpp_extension._get_build_directory(name, False))
    with open(build_dir.parent / f"{name}.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            if _load_built(cpp_extension, name):
                return True
            stale = build_dir / "lock"
            if stale.exists():
                logger.warning("removing %s, left by a build of %s that died", stale, name)
                stale.unlink(missing_ok=True)
            cpp_extension.load(name=name, sources=[str(source)], extra_cflags=["-O3", "-fopenmp"],
                               extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
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
    *,
    sliding_window: int = 0,
    soft_cap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """``reference.paged_attention`` with K/V read in place from the cache for short rows.

    Rows of up to ``MAX_KERNEL_QUERY_LEN`` new tokens (decode) run in the C++ kernel; longer
    rows (prefill, chunked prefill) in the reference's SDPA. ``all_rows`` (batch-invariant mode):
    every row in the kernel, so a token's result does not depend on its row's length (the kernel
    computes each query token alone, in one order over its positions). Needs ``load()`` to have
    succeeded. ``sliding_window``, ``soft_cap`` and ``alibi_slopes``: as the reference (all in the
    kernel too).
    """
    ops = load()
    mods = reference.score_mods(sliding_window, soft_cap, alibi_slopes)
    if all_rows and (ops is None or not _supported(query, kv_cache)):
        raise RuntimeError(f"batch-invariant attention: the C++ kernel does not take {query.dtype} "
                           f"queries over a {kv_cache.dtype} cache")
    if ops is None or not _supported(query, kv_cache):
        return reference.paged_attention(
            query, kv_cache, query_start_loc, seq_lens, block_table, scale, max_query_len, k_scale, v_scale,
            sliding_window=mods.sliding_window, soft_cap=mods.soft_cap, alibi_slopes=mods.alibi_slopes,
        )
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    query = query if query.stride(-1) == 1 else query.contiguous()  # other strides are read as is
    query_start_loc, seq_lens = _int32(query_start_loc), _int32(seq_lens)
    slopes = None if mods.alibi_slopes is None else mods.alibi_slopes.cpu().contiguous()
    ops.paged_attention(
        out, query, kv_cache, query_start_loc, seq_lens, _int32(block_table), float(scale),
        query.shape[0] if all_rows else MAX_KERNEL_QUERY_LEN, float(k_scale), float(v_scale),
        mods.sliding_window, mods.soft_cap, slopes,
    )
    if all_rows:
        return out
    if max_query_len is None or max_query_len > MAX_KERNEL_QUERY_LEN:
        qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
        longer = [i for i in range(len(lens)) if qsl[i + 1] - qsl[i] > MAX_KERNEL_QUERY_LEN]
        reference.prefill_rows(query, kv_cache, qsl, lens, block_table, longer, scale, out, (k_scale, v_scale), mods)
    return out


def paged_attention_short_rows(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    *,
    sliding_window: int = 0,
    sinks: torch.Tensor | None = None,
) -> bool:
    """The C++ kernel on the rows of up to ``MAX_KERNEL_QUERY_LEN`` new tokens only, written into
    ``out`` (shaped as ``query``); longer rows are left as they are, for the caller. ``sinks``
    ([num_heads] logits, or None): attention sinks (gpt-oss), one more term in every softmax's
    denominator. False (nothing written) when the kernel did not build or does not take the dtypes."""
    ops = load()
    if (ops is None or not _supported(query, kv_cache) or out.shape != query.shape or out.dtype != query.dtype
            or out.stride(-1) != 1):
        return False
    query = query if query.stride(-1) == 1 else query.contiguous()
    logits = None if sinks is None else sinks.detach().to(device="cpu", dtype=torch.float32).contiguous()
    ops.paged_attention(out, query, kv_cache, _int32(query_start_loc), _int32(seq_lens), _int32(block_table),
                        float(scale), MAX_KERNEL_QUERY_LEN, float(k_scale), float(v_scale), int(sliding_window),
                        0.0, None, logits)
    return True


def _supported(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    return (query.dtype in _DTYPES and kv_cache.dtype in _CACHE_DTYPES
            and kv_cache.element_size() <= query.element_size() and kv_cache.stride(-1) == 1)


def _int32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.int32).contiguous()


# --- per-token layer ops (layer_ops.cpp) ------------------------------------------------------
# Same signatures and results as the reference (new tensors, never in place on the inputs); a call
# the C++ does not take (another dtype, mixed dtypes, a tensor not on the CPU, a strided last
# dimension, an unusual shape) goes to the reference.


def _plain(*tensors: torch.Tensor) -> bool:
    """All on the CPU, of one kernel dtype, unit stride along the last dimension."""
    dtype = tensors[0].dtype
    return dtype in _DTYPES and all(
        t.device.type == "cpu" and t.dtype == dtype and t.dim() > 0 and t.stride(-1) == 1 for t in tensors)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as [rows, last] without a copy when its leading dims flatten, else a contiguous copy."""
    if x.dim() == 2 and x.stride(1) == 1:
        return x
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        return x.reshape(-1, x.shape[-1]).contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``reference.rms_norm`` (weight of x's dtype; other weight dtypes go to the reference)."""
    ops = load_layer_ops()
    if ops is None or not _plain(x, weight) or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        return reference.rms_norm(x, weight, eps)
    out = torch.empty(x.shape, dtype=x.dtype)
    ops.rms_norm(out, _rows(x), weight.detach().contiguous(), float(eps))
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.fused_add_rms_norm``: ``(rms_norm(x + residual), x + residual)``, new tensors."""
    ops = load_layer_ops()
    if (ops is None or not _plain(x, residual, weight) or residual.shape != x.shape or weight.dim() != 1
            or weight.shape[0] != x.shape[-1]):
        return reference.fused_add_rms_norm(x, residual, weight, eps)
    out = torch.empty(x.shape, dtype=x.dtype)
    residual_out = torch.empty(x.shape, dtype=x.dtype)
    ops.fused_add_rms_norm(out, residual_out, _rows(x), _rows(residual), weight.detach().contiguous(), float(eps))
    return out, residual_out


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor, is_neox: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.rotary_embedding``; ``query`` / ``key`` may be strided views (e.g. of a fused QKV)."""
    ops = load_layer_ops()
    if (ops is None or query.dim() != 3 or key.dim() != 3 or not _plain(query, key)
            or cos_sin_cache.dtype not in _DTYPES or cos_sin_cache.device.type != "cpu"
            or cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] % 2 or cos_sin_cache.shape[1] > query.shape[2]
            or positions.dim() != 1 or positions.shape[0] != query.shape[0] or positions.device.type != "cpu"
            or positions.dtype.is_floating_point or key.shape[0] != query.shape[0] or key.shape[2] != query.shape[2]):
        return reference.rotary_embedding(positions, query, key, cos_sin_cache, is_neox)
    q_out = torch.empty(query.shape, dtype=query.dtype)
    k_out = torch.empty(key.shape, dtype=key.dtype)
    ops.rotary_embedding(q_out, k_out, positions.to(torch.int64).contiguous(), query, key,
                         cos_sin_cache.contiguous(), bool(is_neox))
    return q_out, k_out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``reference.silu_and_mul``: ``silu(x[..., :d]) * x[..., d:]``."""
    ops = load_layer_ops()
    if ops is None or not _plain(x) or x.shape[-1] % 2:
        return reference.silu_and_mul(x)
    out = torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=x.dtype)
    ops.silu_and_mul(out, _rows(x))
    return out


def gelu_and_mul(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``reference.gelu_and_mul``: ``gelu(x[..., :d], approximate) * x[..., d:]``."""
    ops = load_layer_ops()
    if ops is None or not _plain(x) or x.shape[-1] % 2 or approximate not in reference.GELU_APPROXIMATIONS:
        return reference.gelu_and_mul(x, approximate)
    out = torch.empty((*x.shape[:-1], x.shape[-1] // 2), dtype=x.dtype)
    ops.gelu_and_mul(out, _rows(x), approximate == "tanh")
    return out


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``reference.gelu`` (exact or tanh-approximated GELU), a new tensor."""
    ops = load_layer_ops()
    if ops is None or not _plain(x) or approximate not in reference.GELU_APPROXIMATIONS:
        return reference.gelu(x, approximate)
    out = torch.empty(x.shape, dtype=x.dtype)
    ops.gelu(out, _rows(x), approximate == "tanh")
    return out


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """``reference.reshape_and_cache`` (every cache dtype, fp8 included); negative slots are skipped."""
    ops = load_layer_ops()
    if (ops is None or key.dim() != 3 or not _plain(key, value) or value.shape != key.shape
            or kv_cache.dtype not in _CACHE_DTYPES or kv_cache.device.type != "cpu" or kv_cache.dim() != 5
            or kv_cache.shape[0] != 2 or kv_cache.shape[3:] != key.shape[1:] or kv_cache.stride(-1) != 1
            or slot_mapping.dim() != 1 or slot_mapping.shape[0] != key.shape[0]
            or slot_mapping.device.type != "cpu" or slot_mapping.dtype.is_floating_point):
        return reference.reshape_and_cache(key, value, kv_cache, slot_mapping, k_scale, v_scale)
    ops.reshape_and_cache(key, value, kv_cache, slot_mapping.to(torch.int64).contiguous(), float(k_scale),
                          float(v_scale))
