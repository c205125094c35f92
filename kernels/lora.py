"""Batched multi-LoRA: ``y[t] += lora_b[s] @ (lora_a[s] @ x[t])`` for each token's adapter slot ``s``.

The punica / S-LoRA scheme: a step's tokens run on several adapters (or none, slot ``-1``), each
adapter's weights sit in a slot of the layer's stacked ``lora_a`` [S, R, in] / ``lora_b``
[S, out, R] (scaling folded into B). Tokens are grouped by slot, and each group does one *shrink*
GEMM (``x @ A^T``, to rank R) and one *expand* GEMM (``@ B^T``, back to ``out``) added into ``y``.

On CUDA ``add_lora`` runs ``kernels/triton_ops/lora.py`` (imported only then); elsewhere the torch
code below. The model runner orders a step's requests by adapter, so each slot's tokens are
usually one run of consecutive rows: shrink and expand that slice of ``x`` and ``addmm_`` into the
same slice of ``y``, in place (no gather, no scatter: about 30 % less time than gathering at SmolLM2's
shapes); tokens of a slot that are not consecutive are gathered, shrunk, expanded and
``index_add_``-ed. One ``addmm_`` when every token has the same slot, nothing when none has one.
``slot_groups`` does the grouping, which depends only on the step, once for every layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

import torch


@dataclass(frozen=True)
class SlotGroups:
    """A step's tokens by adapter slot: ``(slot, rows)`` per slot used; ``rows`` None: every token,
    a ``(start, stop)`` pair: those consecutive tokens, a tensor: those token indices."""

    groups: tuple[tuple[int, Union[None, tuple[int, int], torch.Tensor]], ...]


def slot_groups(token_slots: torch.Tensor) -> SlotGroups:
    """Group the tokens of ``token_slots`` (int64 [T], -1: no adapter) by slot (CPU path)."""
    slots = token_slots.tolist()
    first = slots[0] if slots else -1
    if all(s == first for s in slots):
        return SlotGroups(((first, None),) if first >= 0 else ())
    rows: dict[int, list[int]] = {}
    for t, s in enumerate(slots):
        if s >= 0:
            rows.setdefault(s, []).append(t)
    device = token_slots.device
    return SlotGroups(tuple((s, (r[0], r[-1] + 1) if r[-1] - r[0] + 1 == len(r)
                             else torch.tensor(r, dtype=torch.int64, device=device)) for s, r in rows.items()))


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
             token_slots: torch.Tensor, groups: Optional[SlotGroups] = None) -> None:
    """``y[t] += lora_b[s] @ (lora_a[s] @ x[t])`` in place for every token ``t`` with
    ``s = token_slots[t] >= 0``; ``x`` [T, in], ``y`` [T, out]. ``groups``: ``slot_groups(token_slots)``
    computed once for the step (the CPU path; CUDA groups on the device)."""
    if x.is_cuda:
        from gridserve.kernels.triton_ops.lora import add_lora_triton

        add_lora_triton(y, x, lora_a, lora_b, token_slots)
        return
    for slot, rows in (groups or slot_groups(token_slots)).groups:
        a, b = lora_a[slot], lora_b[slot]
        if rows is None:
            y.addmm_(x @ a.t(), b.t())
        elif isinstance(rows, tuple):  # consecutive tokens: views of x and y, updated in place
            start, stop = rows
            y[start:stop].addmm_(x[start:stop] @ a.t(), b.t())
        else:
            y.index_add_(0, rows, (x.index_select(0, rows) @ a.t()) @ b.t())
