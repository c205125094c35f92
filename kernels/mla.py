"""Paged MLA decode: attention of absorbed queries over the latent cache, no K/V expanded.

Multi-head latent attention (DeepSeek-V2 / V3) caches one entry per token for every head:
``[c_kv (kv_lora_rank), k_pe (rope_dim)]``, in blocks ``[num_blocks, block_size, kv_lora_rank +
rope_dim]``. With the key up-projection absorbed into the query (``q_latent = q_nope @ W_uk`` per
head), a head's score against position ``j`` is ``scale * (q_latent . c_kv[j] + q_pe . k_pe[j])``:
the query ``[q_latent, q_pe]`` against the whole cache entry. The value is the latent itself, so
the output is ``softmax(scores) @ c_kv`` in latent space ``[kv_lora_rank]`` (the caller applies
``W_uv``). Every head reads the same entries: MQA with one KV head of ``kv_lora_rank + rope_dim``.

``mla_decode(query, kv_cache, query_start_loc, seq_lens, block_table, scale, kv_lora_rank)``:

- ``query`` [num_tokens, num_heads, kv_lora_rank + rope_dim], packed by ``query_start_loc``;
- a row's tokens are its sequence's last ``q_len`` positions (causal among them), as in paged
  attention; decode rows have ``q_len`` 1 (a few with speculative decoding);
- the cache may be narrower than the query (16-bit, or fp8 holding unscaled values);
- returns [num_tokens, num_heads, kv_lora_rank] in the query's dtype.

Implementations, chosen per call by ``dispatch``'s rules (``GRIDSERVE_KERNELS``): Triton
(``triton_ops/mla.py``) for CUDA tensors, the C++ kernel (``cpu_ops/mla_decode.cpp``) for CPU
tensors when it builds, ``reference_mla_decode`` (torch, the ground truth) otherwise.
"""

from __future__ import annotations

import torch

from gridserve.kernels import dispatch
from gridserve.shared import envs


def reference_mla_decode(query: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
                         seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float,
                         kv_lora_rank: int) -> torch.Tensor:
    """The torch MLA decode: every row's positions gathered (padded to the longest), in float32."""
    num_tokens, num_heads, entry = query.shape
    _check(query, kv_cache, kv_lora_rank)
    out = query.new_empty(num_tokens, num_heads, kv_lora_rank)
    if num_tokens == 0 or seq_lens.numel() == 0:
        return out
    device = query.device
    qsl = query_start_loc.to(device=device, dtype=torch.long)
    lens = seq_lens.to(device=device, dtype=torch.long)
    q_lens = qsl[1:] - qsl[:-1]
    seq_of_token = torch.repeat_interleave(torch.arange(lens.numel(), device=device), q_lens)
    # token t of a row with q_len new tokens and context L sees positions < L - q_len + t + 1
    index_in_row = torch.arange(num_tokens, device=device) - qsl[seq_of_token]
    visible = (lens - q_lens)[seq_of_token] + index_in_row + 1
    longest = int(lens.max())
    block_size = kv_cache.shape[1]
    positions = torch.arange(longest, device=device)
    blocks = block_table.to(device=device, dtype=torch.long)[:, positions // block_size]  # [S, longest]
    slots = blocks * block_size + positions % block_size
    entries = kv_cache.reshape(-1, entry)[slots.reshape(-1)].float().view(lens.numel(), longest, entry)
    rows = entries[seq_of_token]  # [T, longest, entry]
    scores = torch.einsum("the,tle->thl", query.float(), rows) * scale
    masked = positions[None, :] >= visible[:, None]  # [T, longest]
    scores = scores.masked_fill(masked[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out.copy_(torch.einsum("thl,tlr->thr", probs, rows[..., :kv_lora_rank]))
    return out


def _check(query: torch.Tensor, kv_cache: torch.Tensor, kv_lora_rank: int) -> None:
    if query.dim() != 3 or kv_cache.dim() != 3:
        raise ValueError(f"mla_decode: query [tokens, heads, entry] and kv_cache [blocks, block_size, entry] "
                         f"expected, got {tuple(query.shape)} and {tuple(kv_cache.shape)}")
    if query.shape[2] != kv_cache.shape[2] or not 0 < kv_lora_rank <= query.shape[2]:
        raise ValueError(f"mla_decode: query entry {query.shape[2]}, cache entry {kv_cache.shape[2]} and "
                         f"kv_lora_rank {kv_lora_rank} disagree")


def mla_decode(query: torch.Tensor, kv_cache: torch.Tensor, query_start_loc: torch.Tensor,
               seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float,
               kv_lora_rank: int) -> torch.Tensor:
    """Paged MLA decode (module docstring) by the implementation ``GRIDSERVE_KERNELS`` picks."""
    return implementation(query)(query, kv_cache, query_start_loc, seq_lens, block_table, scale, kv_lora_rank)


def implementation(query: torch.Tensor):
    """The ``mla_decode`` function for a step whose queries are ``query``: Triton for CUDA tensors (or
    any under ``GRIDSERVE_KERNELS=triton``), the C++ kernel for CPU tensors under ``auto`` / ``cpu``
    (``cpu``: raises when it did not build), the reference otherwise."""
    mode = envs.GRIDSERVE_KERNELS
    if mode != "reference" and (query.is_cuda or mode == "triton"):
        ops = dispatch._triton_ops()
        if ops is not None:
            return ops.mla_decode
        if mode == "triton":
            raise RuntimeError("GRIDSERVE_KERNELS=triton but Triton cannot be imported (mla_decode)")
    if mode in ("auto", "cpu") and query.device.type == "cpu":
        from gridserve.kernels.cpu_ops import mla as cpu_mla

        if cpu_mla.load() is not None:
            return cpu_mla.mla_decode
        if mode == "cpu":
            raise RuntimeError("GRIDSERVE_KERNELS=cpu but the C++ MLA decode kernel did not build")
    return reference_mla_decode
