"""int8-weight CPU GEMM (``int8_gemm.cpp``), compiled on first use and cached: activations as
int16 rows (one scale per row), or as int8 with one scale per 32 columns (``activation_group=32``).

``load()`` builds the extension the first time a worker quantizes a layer on CPU, as the
paged-attention kernel is built, and returns None (reason logged) when it cannot: no compiler,
no ninja, a build error. Callers then keep the torch path (two int8 rows per activation through
``torch._int_mm``). The instruction set is chosen at run time (AVX-512 VNNI, AVX2, else scalar),
so one build serves every x86 CPU.

On a CPU with AMX (``onednn_available()``), the int16 mode's product goes to oneDNN's int8
matmul instead (its AMX kernel, through ``torch.ops.onednn.qlinear_pointwise``): the same int16
rows, split into their two int8 digits as the VNNI tile splits them, as twice the rows of one
int8 x int8 matmul, combined by this extension's epilogue (``onednn_gemm``). 2.3-4x the VNNI
kernel at decode batch sizes where measured (docs/benchmarks/README.md, int8-gemm). ``GRIDSERVE_INT8_ONEDNN=0`` keeps the VNNI
kernel; ``=1`` uses oneDNN without AMX too, where the CPU has VNNI (``cpu_has_int8_dot``: AVX2
alone saturates).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Optional

import torch

from gridserve.shared import envs

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("int8_gemm.cpp")
ISA_NAMES = ("scalar", "avx2", "avx512-vnni")
GROUP = 64  # output columns per packed group (the kernel's kGroup)
ACTIVATION_GROUP = 32  # input columns per activation scale in the int8-activation mode (kActGroup)


@functools.lru_cache(maxsize=1)
def load():
    """The ``torch.ops.gridserve_int8_gemm`` namespace, or None when it cannot be built."""
    from gridserve.kernels.cpu_ops import load_library

    # No -mavx2 for the whole file: the tiles carry their own target attributes and are picked at
    # run time, so the library also loads on CPUs without AVX2.
    if not load_library(_SOURCE, "gridserve_cpu_int8_gemm", "int8 x int16 CPU GEMM", "torch._int_mm"):
        return None
    ops = torch.ops.gridserve_int8_gemm
    logger.info("int8 x int16 CPU GEMM: %s", ISA_NAMES[ops.isa()])
    return ops


def isa() -> Optional[str]:
    """The instruction set the kernel runs on this CPU, or None when it is unavailable."""
    ops = load()
    return None if ops is None else ISA_NAMES[ops.isa()]


def pack(qweight: torch.Tensor) -> torch.Tensor:
    """int8 [n, k] -> the kernel's layout (uint8 = value + 128, zero weights padding n to 64s, k to 4s)."""
    ops = load()
    n, k = qweight.shape
    packed = torch.empty(ops.packed_numel(n, k), dtype=torch.uint8)
    ops.pack(packed, qweight.contiguous())
    return packed


def unpack(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The int8 [n, k] weight ``pack`` laid out (for checks and the dequantized form)."""
    quads = (k + 3) // 4
    groups = packed.reshape(-1, quads, GROUP, 4)  # [g, q, c, t] = w[64 g + c, 4 q + t] + 128
    w = groups.permute(0, 2, 1, 3).reshape(-1, 4 * quads)[:n, :k]
    return (w.to(torch.int16) - 128).to(torch.int8)


def gemm(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, n: int,
    bias: Optional[torch.Tensor] = None, isa_cap: int = 2, activation_group: int = 0,
    out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``(x quantized) @ (packed int8).T * scales (+ bias)`` for float32 ``x`` [m, k] -> [m, n].

    ``activation_group``: 0 quantizes each row of ``x`` to int16 with one scale; ``ACTIVATION_GROUP``
    (32) to int8 with one scale per 32 columns (one ``vpdpbusd`` per 4 MACs instead of two).
    ``isa_cap`` (0 scalar, 1 AVX2, 2 AVX-512 VNNI) caps the instruction set, for tests. ``out``: a
    contiguous float32 [m, n] to write into (e.g. one expert's rows of a MoE layer's output)."""
    if out is None:
        out = torch.empty(x.shape[0], n, dtype=torch.float32)
    load().gemm(out, x.contiguous(), packed, scales, bias, isa_cap, activation_group)
    return out


def quantize_groups(x: torch.Tensor, isa_cap: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's grouped activations of float32 ``x`` [m, k] (for checks): int8 values [m, kp]
    (kp: k rounded up to 32, zero-padded), scales [m, kp / 32] and the rows' weight-offset terms."""
    m, k = x.shape
    kp = -(-k // ACTIVATION_GROUP) * ACTIVATION_GROUP
    q = torch.empty(m, kp, dtype=torch.int8)
    group_scale = torch.empty(m, kp // ACTIVATION_GROUP)
    offset = torch.empty(m)
    load().quantize_groups(q, group_scale, offset, x.contiguous(), isa_cap)
    return q, group_scale, offset


# Rows of activations per oneDNN call, so that a call's float32 products (two digit rows per row)
# stay within ~8 MB: at the LM head's width 512 digit rows took 23.5 ms here against 4 x 1.5 ms
# for 128; at 2,304 columns 512 digit rows were fine (0.42 ms).
ONEDNN_CHUNK_ELEMENTS = 1 << 21
ONEDNN_MAX_ROWS = 256


def onednn_rows(n: int) -> int:
    """Rows of activations per oneDNN call for an output of ``n`` columns."""
    return max(16, min(ONEDNN_MAX_ROWS, ONEDNN_CHUNK_ELEMENTS // max(n, 1) // 16 * 16))


@functools.lru_cache(maxsize=1)
def cpu_has_int8_dot() -> bool:
    """Whether this CPU has an int8 dot product that sums into int32 (AVX-512 VNNI, AVX-VNNI or AMX).
    Without one (AVX2 alone) oneDNN's u8 x s8 kernel adds pairs of products in saturating int16
    (``vpmaddubsw``): the low digit rows (0..255) against int8 weights overflow it, and the product
    is wrong by percents. Read from /proc/cpuinfo; elsewhere assumed present."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return True
    return bool(flags & {"avx512_vnni", "avx_vnni", "amx_int8"})


@functools.lru_cache(maxsize=1)
def onednn_available() -> bool:
    """Whether the int16 mode runs through oneDNN's int8 matmul here: a CPU with AMX tiles (where
    oneDNN picks its AMX kernel), torch's ``onednn`` quantized-linear ops, and this extension (for
    the quantization and the epilogue). ``GRIDSERVE_INT8_ONEDNN``: ``0`` never, ``1`` whenever the
    ops exist (tests on CPUs without AMX), else automatic."""
    setting = envs.GRIDSERVE_INT8_ONEDNN
    if setting == "0":
        return False
    ops_exist = torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")
    amx = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
    if setting == "1" and not amx and not cpu_has_int8_dot():
        logger.warning("GRIDSERVE_INT8_ONEDNN=1 ignored: this CPU has no VNNI or AMX, and oneDNN's int8 "
                       "matmul saturates without them; the C++ int8 GEMM runs instead")
        return False
    ok = ops_exist and (setting == "1" or amx) and load() is not None
    if ok:
        logger.info("int8 CPU GEMM: oneDNN's int8 matmul%s", " (AMX)" if amx else "")
    return ok


def onednn_pack(qweight: torch.Tensor) -> torch.Tensor:
    """int8 [n, k] -> oneDNN's packed weight (an opaque mkldnn tensor)."""
    return torch.ops.onednn.qlinear_prepack(qweight.contiguous(), None)


def onednn_gemm(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, n: int,
    bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``gemm``'s int16 mode through oneDNN: float32 ``x`` [m, k] -> [m, n]."""
    ops = load()
    x = x.contiguous()
    m, k = x.shape
    out = torch.empty(m, n, dtype=torch.float32)
    ones, zeros = _unit_scales(n)
    step = onednn_rows(n)
    for r0 in range(0, m, step):
        rows = x[r0:r0 + step]
        planes = torch.empty(2 * rows.shape[0], k, dtype=torch.int8)
        row_scales = torch.empty(rows.shape[0])
        ops.quantize_planes(planes, row_scales, rows)
        acc = torch.ops.onednn.qlinear_pointwise(
            planes, 1.0, 0, packed, ones, zeros, None, 1.0, 0, torch.float32, "none", [], ""
        )
        ops.combine_planes(out[r0:r0 + step], acc, row_scales, scales, bias)
    return out


@functools.lru_cache(maxsize=64)
def _unit_scales(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """oneDNN's per-column weight scales and zero points, left to the epilogue: 1 and 0."""
    return torch.ones(n), torch.zeros(n, dtype=torch.long)
