"""fp32 and bf16 linear layers on the CPU with their weights held in oneDNN's blocked layout.

``F.linear(x, W)`` hands the plain ``[N, K]`` weight to MKL's sgemm, which repacks it into its
own panels on every call. Reordered once after loading (``torch.ops.mkldnn._reorder_linear_weight``),
a weight is read by ``torch.ops.mkldnn._linear_pointwise`` as it lies, for any number of rows
(measured per layer shape and in W: docs/benchmarks/README.md, "Deleted experiments"; "Where a decode step goes"
has the figures). The packed weight *replaces* the plain one (one copy resident): the layer's
``weight`` parameter becomes the oneDNN tensor, same shape and dtype, so names, shapes and the
memory accounting stay as they were.

Results are not bit-identical to ``F.linear`` (another summation order: ~1e-6 relative in fp32;
in bf16 both accumulate in fp32 and round the output to bf16, so they differ by about one bf16 ulp).
bf16 weights are packed only where the CPU computes bf16 natively (AVX-512 BF16 or AMX on x86,
checked at run time: ``native_bf16``); elsewhere oneDNN would emulate it and they stay plain.
Measured: docs/benchmarks/README.md, "bf16 on the CPU (issue 40)".
Only plain fp32 / bf16 CPU weights are packed: not quantized layers (``qweight``), not
batch-invariant ones (their fixed-block GEMMs stay as they are), not an embedding that is also the
LM head (its rows are looked up). Loading into a packed layer (weight sync) restores the plain
weight first; ``repack`` packs it again. ``GRIDSERVE_CPU_PACKED_LINEAR=0`` turns the whole path off (A/B).
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

import torch
from torch import nn

from gridserve.shared import envs

logger = logging.getLogger(__name__)


def available() -> bool:
    """Whether this torch build has oneDNN and its packed-linear ops."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(torch.ops.mkldnn._reorder_linear_weight and torch.ops.mkldnn._linear_pointwise)
    except (AttributeError, RuntimeError):
        return False


@functools.lru_cache(maxsize=1)
def native_bf16() -> bool:
    """Whether oneDNN runs bf16 GEMMs in hardware here: x86 with AVX-512 BF16 or AMX (elsewhere,
    as on AVX-512 cores without BF16, it emulates them), or another CPU oneDNN says has bf16."""
    try:
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False
        if torch.backends.cpu.get_cpu_capability().startswith("AVX"):  # x86
            return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
        return True
    except (AttributeError, RuntimeError):
        return False


def packable(weight: Optional[torch.Tensor]) -> bool:
    """A plain, materialized fp32 CPU weight matrix, or a bf16 one where the CPU has native bf16."""
    if weight is None or weight.is_mkldnn or weight.device.type != "cpu" or weight.dim() != 2:
        return False
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and native_bf16())


def pack(weight: torch.Tensor) -> nn.Parameter:
    """``weight`` ([N, K], fp32 or bf16) reordered into oneDNN's blocked layout, frozen."""
    return nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None),
                        requires_grad=False)


def unpack(weight: torch.Tensor) -> nn.Parameter:
    """The plain ``[N, K]`` parameter again (exactly the values that were packed)."""
    return nn.Parameter(weight.to_dense())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` with a packed ``weight``; ``x`` of its dtype, any leading shape."""
    if not x.is_contiguous():
        x = x.contiguous()
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def pack_model(model: nn.Module, device: torch.device) -> int:
    """Pack every eligible layer of ``model`` (a no-op off the CPU or when disabled); returns how many."""
    if device.type != "cpu" or not envs.GRIDSERVE_CPU_PACKED_LINEAR or not available():
        return 0
    packed = sum(1 for m in model.modules() if hasattr(m, "pack_for_cpu") and m.pack_for_cpu())
    packed += _pack_tied_head(model)
    if packed:
        logger.info("packed %d linear weights into oneDNN's layout "
                    "(GRIDSERVE_CPU_PACKED_LINEAR=0: off)", packed)
    return packed


def repack(model: nn.Module) -> int:
    """Pack again the layers ``pack_model`` chose whose plain weight was restored by a load."""
    again = sum(1 for m in model.modules() if getattr(m, "cpu_packed", False) and m.pack_for_cpu())
    return again + _pack_tied_head(model)


def _pack_tied_head(model: nn.Module) -> int:
    """A tied LM head's packed copy (vocab x hidden floats more): the logits GEMM is a decode
    step's largest with a big vocabulary, and a plain ``F.linear`` is ~3x slower than packed."""
    head = getattr(model, "logits_head", None)
    return int(head is not None and hasattr(head, "pack_head_copy") and head.pack_head_copy())


def release(model: nn.Module) -> int:
    """Swap each packed weight for an empty one of its shape on the meta device (before
    ``model.to_empty``, which oneDNN tensors do not support); the layer packs again once reloaded."""
    count = 0
    for m in model.modules():
        if hasattr(m, "release_packed_copy") and m.release_packed_copy():
            count += 1
        weight = getattr(m, "weight", None)
        if getattr(m, "cpu_packed", False) and weight is not None and weight.is_mkldnn:
            m.weight = nn.Parameter(torch.empty(weight.shape, dtype=weight.dtype, device="meta"))
            count += 1
    return count
