"""int8-weight CPU GEMM (``int8_gemm.cpp``), compiled on first use and cached: activations as
int16 rows (one scale per row), or as int8 with one scale per 32 columns (``activation_group=32``).

``load()`` builds the extension the first time a worker quantizes a layer on CPU, as the
paged-attention kernel is built, and returns None (reason logged) when it cannot: no compiler,
no ninja, a build error. Callers then keep the torch path (two int8 rows per activation through
``torch._int_mm``). The instruction set is chosen at run time (AVX-512 VNNI, AVX2, else scalar),
so one build serves every x86 CPU.
"""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path
from typing import Optional

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("int8_gemm.cpp")
ISA_NAMES = ("scalar", "avx2", "avx512-vnni")
GROUP = 64  # output columns per packed group (the kernel's kGroup)
ACTIVATION_GROUP = 32  # input columns per activation scale in the int8-activation mode (kActGroup)


@functools.lru_cache(maxsize=1)
def load():
    """The ``torch.ops.gridserve_int8_gemm`` namespace, or None when it cannot be built."""
    if not _SOURCE.is_file():
        logger.warning("int8 x int16 CPU GEMM unavailable: %s missing", _SOURCE)
        return None
    try:
        from gridserve.kernels.cpu_ops import build_extension

        start = time.perf_counter()
        # No -mavx2 for the whole file: the tiles carry their own target attributes and are
        # picked at run time, so the library also loads on CPUs without AVX2.
        if not build_extension(_SOURCE, "gridserve_cpu_int8_gemm"):
            logger.info("Built the int8 x int16 CPU GEMM (once, then cached)")
    except Exception as exc:  # a missing compiler / ninja or a build error: fall back, don't crash
        logger.warning("int8 x int16 CPU GEMM unavailable, using torch._int_mm: %s", exc)
        return None
    ops = torch.ops.gridserve_int8_gemm
    logger.info("int8 x int16 CPU GEMM ready (%s, %.2f s)", ISA_NAMES[ops.isa()], time.perf_counter() - start)
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
) -> torch.Tensor:
    """``(x quantized) @ (packed int8).T * scales (+ bias)`` for float32 ``x`` [m, k] -> [m, n].

    ``activation_group``: 0 quantizes each row of ``x`` to int16 with one scale; ``ACTIVATION_GROUP``
    (32) to int8 with one scale per 32 columns (one ``vpdpbusd`` per 4 MACs instead of two).
    ``isa_cap`` (0 scalar, 1 AVX2, 2 AVX-512 VNNI) caps the instruction set, for tests."""
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
