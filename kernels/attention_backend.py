"""``AttentionBackend``: what an implementation of paged attention provides, and the one factory
that picks it (``select_attention_backend``).

A backend does two things per layer and step, over one layer's paged KV cache
(``[2, num_blocks, block_size, num_kv_heads, head_size]``, layout in ``reference``):

- ``write_kv``: store the step's new keys and values at ``meta.slot_mapping``;
- ``attend``: attention of the step's packed queries over their sequences' cached K/V
  (causal among a sequence's new tokens, full attention to its cached prefix), optionally with a
  sliding window, a logit soft cap and ALiBi (Hugging Face semantics, ``reference``'s docstring).

Implementations: ``KernelAttention`` over ``reference`` (torch, the ground truth), ``cpu_ops``
(the C++ kernels; each call the C++ does not take, or whose library did not build, runs the
reference) or ``triton_ops``. ``BatchInvariantAttention`` wraps one of them:
every query row through the C++ kernel (CPU only). All give the reference's results within each
kernel's tested tolerance.

``select_attention_backend`` applies ``dispatch``'s rules (``GRIDSERVE_KERNELS``) per call:
Triton for CUDA tensors (or any tensor under ``triton``), the C++ backend for CPU tensors under
``auto`` / ``cpu`` (``cpu``: both C++ libraries must build), the reference otherwise. Triton and
the C++ kernels are imported only when picked.
"""

from __future__ import annotations

import contextlib
import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from gridserve.kernels import dispatch
from gridserve.shared import envs


@dataclass
class AttentionMetadata:
    """Where each of a step's packed tokens sits (the layout is in ``gridserve.kernels.reference``)."""

    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    block_table: torch.Tensor  # [num_seqs, max_blocks] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64
    max_query_len: int
    # KV cache groups 1.. of a model that mixes layer kinds (``gridserve.shared.kv_cache_spec``):
    # the same batch with each group's block table and slot mapping; this one is group 0's.
    other_groups: tuple[AttentionMetadata, ...] = ()

    def group(self, index: int) -> AttentionMetadata:
        """The metadata a layer of KV cache group ``index`` attends with."""
        return self if index == 0 else self.other_groups[index - 1]


class AttentionBackend(ABC):
    """One implementation of paged attention. Stateless: one instance serves every layer.

    Both methods take the step's ``AttentionMetadata`` and one layer's ``kv_cache``, which may be
    narrower than the activations: 16-bit values are cast on write and read; fp8 values hold
    ``key / k_scale`` and ``value / v_scale`` (per-tensor scales, saturated to the format's range)
    and are multiplied back when read.
    """

    name: str  # "reference", "cpu", "triton", "batch-invariant"

    @abstractmethod
    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                 k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        """Store ``key`` / ``value`` ([num_tokens, num_kv_heads, head_size]) in ``kv_cache`` at
        ``meta.slot_mapping`` (``block_id * block_size + offset`` per token), in place."""

    @abstractmethod
    def attend(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
               k_scale: float = 1.0, v_scale: float = 1.0, *, sliding_window: int = 0, soft_cap: float = 0.0,
               alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of ``query`` ([num_tokens, num_heads, head_size], packed by
        ``meta.query_start_loc``) over each sequence's ``meta.seq_lens`` cached positions (the new
        tokens' K/V already written); a new tensor shaped and typed as ``query``. ``num_heads`` is
        a multiple of the cache's ``num_kv_heads`` (GQA / MQA). ``sliding_window`` (0 = none),
        ``soft_cap`` (0 = none) and ``alibi_slopes`` ([num_heads] or None) modify the scores as
        ``reference`` documents."""


def _serial(key: torch.Tensor) -> contextlib.AbstractContextManager:
    """The KV write of a decode-sized CPU step on one thread (``dispatch.SERIAL_CPU_OPS``)."""
    if (key.device.type == "cpu" and "reshape_and_cache" in dispatch.SERIAL_CPU_OPS
            and key.numel() <= dispatch.SERIAL_MAX_ELEMENTS):
        return dispatch.one_thread()
    return contextlib.nullcontext()


def _score_mods(sliding_window: int, soft_cap: float, alibi_slopes: torch.Tensor | None) -> dict:
    """The modifiers that are on, as the kernels' keywords: a plain model's call is the call it
    always was."""
    mods: dict = {}
    if sliding_window:
        mods["sliding_window"] = sliding_window
    if soft_cap:
        mods["soft_cap"] = soft_cap
    if alibi_slopes is not None:
        mods["alibi_slopes"] = alibi_slopes
    return mods


class KernelAttention(AttentionBackend):
    """The two ops of one kernels module, which all take the reference's signatures:
    ``reference`` (torch, any device and dtype: the ground truth), ``cpu_ops`` (the C++ KV write of
    ``layer_ops.cpp`` and attention of short rows in ``paged_attention.cpp``; longer rows through
    the reference's SDPA) or ``triton_ops`` (CUDA, or any device under ``TRITON_INTERPRET=1``).
    The module is imported on first use."""

    def __init__(self, name: str, module: str) -> None:
        self.name = name
        self._module = f"gridserve.kernels.{module}"

    def _ops(self):
        return importlib.import_module(self._module)

    def write_kv(self, key, value, kv_cache, meta, k_scale=1.0, v_scale=1.0) -> None:
        with _serial(key):
            self._ops().reshape_and_cache(key, value, kv_cache, meta.slot_mapping, k_scale, v_scale)

    def attend(self, query, kv_cache, meta, scale, k_scale=1.0, v_scale=1.0, *, sliding_window=0, soft_cap=0.0,
               alibi_slopes=None) -> torch.Tensor:
        return self._ops().paged_attention(query, kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_table,
                                           scale, meta.max_query_len, k_scale, v_scale,
                                           **_score_mods(sliding_window, soft_cap, alibi_slopes))


class BatchInvariantAttention(AttentionBackend):
    """``base``'s KV write; attention of every row, prefill or decode, in the C++ kernel, so a
    token's result depends neither on the batch nor on its row's length (``batch_invariant.py``).
    CPU only; raises when the kernel did not build or does not take the dtypes."""

    name = "batch-invariant"

    def __init__(self, base: AttentionBackend) -> None:
        self.base = base

    def write_kv(self, key, value, kv_cache, meta, k_scale=1.0, v_scale=1.0) -> None:
        self.base.write_kv(key, value, kv_cache, meta, k_scale, v_scale)

    def attend(self, query, kv_cache, meta, scale, k_scale=1.0, v_scale=1.0, *, sliding_window=0, soft_cap=0.0,
               alibi_slopes=None) -> torch.Tensor:
        if query.device.type != "cpu":
            raise RuntimeError("batch-invariant attention is implemented for the CPU only")
        from gridserve.kernels import cpu_ops

        if cpu_ops.load() is None:
            raise RuntimeError("batch-invariant mode needs the C++ CPU paged-attention kernel, which did not build")
        return cpu_ops.paged_attention(query, kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_table,
                                       scale, None, k_scale, v_scale, all_rows=True,
                                       **_score_mods(sliding_window, soft_cap, alibi_slopes))


REFERENCE = KernelAttention("reference", "reference")
CPU = KernelAttention("cpu", "cpu_ops")
TRITON = KernelAttention("triton", "triton_ops")
_BATCH_INVARIANT = {backend.name: BatchInvariantAttention(backend) for backend in (REFERENCE, CPU, TRITON)}


def select_attention_backend(query: torch.Tensor, batch_invariant: bool = False) -> AttentionBackend:
    """The backend for a step whose queries are ``query`` (its device decides, with
    ``GRIDSERVE_KERNELS``; see the module docstring). Raises under ``triton`` without Triton and
    under ``cpu`` when a C++ library did not build."""
    mode = envs.GRIDSERVE_KERNELS
    backend = REFERENCE
    if mode != "reference" and (query.is_cuda or mode == "triton"):
        if dispatch._triton_ops() is not None:
            backend = TRITON
        elif mode == "triton":
            raise RuntimeError("GRIDSERVE_KERNELS=triton but no Triton kernel for paged attention "
                               "(Triton cannot be imported)")
    elif mode in ("auto", "cpu") and query.device.type == "cpu":
        if mode == "cpu":
            for name in ("reshape_and_cache", "paged_attention"):
                dispatch._cpu_kernel(name, mode)  # raises when its library did not build
        backend = CPU
    return _BATCH_INVARIANT[backend.name] if batch_invariant else backend
