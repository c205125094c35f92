"""Multi-head latent attention (MLA, DeepSeek-V2 / V3) as a model layer over a paged latent cache.

MLA caches one vector per token for all heads: the normalised latent ``c_kv`` (``kv_lora_rank``
wide) and the rotated, head-shared rope key ``k_pe`` (``qk_rope_head_dim``), side by side in a
block ``[block_size, kv_lora_rank + qk_rope_head_dim]``. The cache is the same on every
tensor-parallel rank (the latent is not split by heads), so its bytes per token are not divided by
the TP size. ``kv_b_proj`` ([heads * (qk_nope + v), kv_lora_rank], this rank's heads) maps a latent
to a head's ``k_nope`` and ``v``; a head's key is ``[k_nope, k_pe]`` and its query ``[q_nope, q_pe]``.

Two ways to attend, chosen per sequence of the step:

- **expand** (prefill, chunks of more than ``ABSORB_MAX_QUERY_LEN`` new tokens): the sequence's
  latents are gathered through its block table and expanded by ``kv_b_proj`` into every head's K
  and V, then SDPA, causally;
- **absorb** (decode, as vLLM does it): ``W_uk`` (the ``k_nope`` rows of ``kv_b_proj``, per head)
  is folded into the query, ``q_latent = q_nope @ W_uk`` [heads, kv_lora_rank], so
  ``q_nope . k_nope = q_latent . c_kv``; ``[q_latent, q_pe]`` attends over the cache entries in
  place (``gridserve.kernels.mla.mla_decode``: C++ on CPU, Triton on CUDA, torch otherwise) and
  the output, a mix of latents, goes through ``W_uv`` (the ``v`` rows) per head. Nothing of the
  cache is expanded: a decode token costs ``heads x context x (kv_lora_rank + rope)`` instead of
  ``context x kv_lora_rank x heads x (qk_nope + v)``.

``W_uk`` / ``W_uv`` are split from ``kv_b_proj`` on the first forward after a load
(``weights_changed``: the model calls it after ``load_weights``, hence after a weight sync too),
from its float weight, plain or oneDNN-packed, or from its int8 / int4 weight dequantized once.
They are buffers, so a sleep that saves and restores the state dict keeps them. Absorption is off
(every row expands) in batch-invariant mode (a token's result must not depend on its row's length)
and when ``kv_b_proj`` carries a LoRA attachment (the adapter's delta is not in the weight).
"""

from __future__ import annotations

import logging
from typing import Optional, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from gridserve.kernels.attention_backend import AttentionMetadata
from gridserve.kernels.mla import mla_decode
from gridserve.kernels.reference import FP8_DTYPES, to_cache_dtype
from gridserve.shared.kv_cache_spec import MLA, LayerKVCacheSpec

logger = logging.getLogger(__name__)

# Rows with at most this many new tokens attend with the absorbed weights (decode, speculative
# verification); longer ones expand (their GEMMs amortise the expansion over many queries).
ABSORB_MAX_QUERY_LEN = 4


class UpProjection(Protocol):
    """``kv_b_proj`` as MLA uses it: latents [n, kv_lora_rank] -> [n, heads * (qk_nope + v)]
    (a ``ColumnParallelLinear``: ``weight``, possibly oneDNN-packed, or ``qweight``; ``lora``)."""

    def __call__(self, latent: torch.Tensor) -> torch.Tensor: ...


def dense_weight(layer: UpProjection) -> tuple[Optional[torch.Tensor], str]:
    """``layer``'s weight [out, in] as plain values (an int8 / int4 weight dequantized, a packed one
    unpacked), or None and why when the layer's output is not ``x @ W.T`` alone (a LoRA attachment,
    a bias, no weight to read)."""
    if getattr(layer, "lora", None) is not None:
        return None, "kv_b_proj carries a LoRA attachment"
    if getattr(layer, "bias", None) is not None:
        return None, "kv_b_proj has a bias"
    qweight = getattr(layer, "qweight", None)
    if qweight is not None:
        return qweight.dequantize(), ""
    weight = getattr(layer, "weight", None)
    if not isinstance(weight, torch.Tensor):
        return None, f"{type(layer).__name__} has no weight to split"
    return (weight.to_dense() if weight.is_mkldnn else weight.detach()), ""


class MLAAttention(nn.Module):
    """Writes the step's latents into this layer's cache blocks, then attends over each sequence's.

    The interface is ``PagedAttention``'s as the model runner sees it: ``kv_cache_spec`` /
    ``kv_cache_shape``, and ``kv_cache`` / ``kv_cache_group`` bound once the cache is allocated;
    before that (the memory profiling run) each sequence attends over its own new tokens only.
    """

    def __init__(self, num_heads: int, qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int,
                 kv_lora_rank: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qk_nope_head_dim = qk_nope_head_dim
        self.qk_rope_head_dim = qk_rope_head_dim
        self.v_head_dim = v_head_dim
        self.kv_lora_rank = kv_lora_rank
        self.scale = scale
        self.kv_cache = torch.empty(0)
        self.kv_cache_group = 0
        self.batch_invariant = False  # every row expands (``batch_invariant.enable``)
        # W_uk [heads, qk_nope, kv_lora_rank] and W_uv [heads, kv_lora_rank, v]: empty until split
        self.register_buffer("w_uk", torch.empty(0))
        self.register_buffer("w_uv", torch.empty(0))
        self._split_pending = True  # split them on the next forward (``weights_changed``)

    @property
    def entry_size(self) -> int:
        """One token's cache entry: the latent and the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def absorbs(self) -> bool:
        """Whether decode rows attend with the absorbed weights."""
        return self.w_uk.numel() > 0 and not self.batch_invariant

    def kv_cache_spec(self, layer_name: str, block_size: int, dtype_bytes: int) -> LayerKVCacheSpec:
        """One latent + rope key per token, the same on every TP rank."""
        return LayerKVCacheSpec(layer_name, MLA, block_size, self.entry_size * dtype_bytes,
                                kv_lora_rank=self.kv_lora_rank, qk_rope_head_dim=self.qk_rope_head_dim)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, block_size, self.entry_size)

    def weights_changed(self) -> None:
        """``kv_b_proj`` was (re)loaded: split ``W_uk`` / ``W_uv`` again on the next forward (after
        the loader's quantization and packing, which change its form but not its values)."""
        self._split_pending = True

    def absorb(self, kv_b_proj: UpProjection, dtype: torch.dtype) -> None:
        """Split ``W_uk`` / ``W_uv`` out of ``kv_b_proj`` (this rank's heads) in the activations'
        ``dtype``; with no usable weight (``dense_weight`` None) the buffers stay empty and every
        row expands."""
        self._split_pending = False
        weight, why = dense_weight(kv_b_proj)
        if weight is None:
            logger.info("MLA: %s; decode expands the latents", why)
            self.w_uk, self.w_uv = torch.empty(0), torch.empty(0)
            return
        per_head = weight.to(dtype).view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        self.w_uk = per_head[:, : self.qk_nope_head_dim].contiguous()
        self.w_uv = per_head[:, self.qk_nope_head_dim :].transpose(1, 2).contiguous()

    def forward(self, q: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor, meta: AttentionMetadata,
                kv_b_proj: UpProjection) -> torch.Tensor:
        """``q`` [tokens, heads * qk_head_dim] (rope part rotated), ``latent`` [tokens, kv_lora_rank]
        (normalised), ``k_pe`` [tokens, qk_rope_head_dim] (rotated); returns [tokens, heads * v_head_dim]."""
        if self._split_pending:
            self.absorb(kv_b_proj, q.dtype)
        q = q.view(-1, self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim)
        entries = torch.cat((latent, k_pe), dim=-1)
        out = q.new_empty(q.shape[0], self.num_heads, self.v_head_dim)
        bounds = meta.query_start_loc.tolist()
        if self.kv_cache.numel() == 0:
            for start, end in zip(bounds[:-1], bounds[1:]):
                out[start:end] = self._attend(q[start:end], entries[start:end], kv_b_proj)
            return out.view(q.shape[0], -1)
        if self.kv_cache_group:
            meta = meta.group(self.kv_cache_group)
        flat = self.kv_cache.view(-1, self.entry_size)
        _write(flat, meta.slot_mapping, entries)
        short = self._absorbed_rows(bounds)
        if short:
            self._decode(q, meta, bounds, short, out)
        block_size = self.kv_cache.shape[1]
        for i, (start, end, seq_len) in enumerate(zip(bounds[:-1], bounds[1:], meta.seq_lens.tolist())):
            if end == start or i in short:
                continue
            positions = torch.arange(seq_len, device=q.device)
            slots = meta.block_table[i, positions // block_size].long() * block_size + positions % block_size
            out[start:end] = self._attend(q[start:end], flat[slots].to(q.dtype), kv_b_proj)
        return out.view(q.shape[0], -1)

    def _absorbed_rows(self, bounds: list[int]) -> set[int]:
        """The rows (sequences) of the step that attend with the absorbed weights."""
        if not self.absorbs:
            return set()
        return {i for i in range(len(bounds) - 1) if 0 < bounds[i + 1] - bounds[i] <= ABSORB_MAX_QUERY_LEN}

    def _decode(self, q: torch.Tensor, meta: AttentionMetadata, bounds: list[int], rows: set[int],
                out: torch.Tensor) -> None:
        """``out`` of ``rows``' tokens: absorbed query over the latent cache in place, then ``W_uv``."""
        if len(rows) == len(bounds) - 1:  # a pure decode step: every token, no gathering
            tokens, qsl, seq_lens, table = None, meta.query_start_loc, meta.seq_lens, meta.block_table
        else:
            order = sorted(rows)
            tokens = torch.cat([torch.arange(bounds[i], bounds[i + 1]) for i in order]).to(q.device)
            lens = torch.tensor([bounds[i + 1] - bounds[i] for i in order])
            qsl = torch.cat((torch.zeros(1, dtype=torch.int32), lens.cumsum(0).to(torch.int32))).to(q.device)
            picked = torch.tensor(order, device=meta.seq_lens.device)
            seq_lens, table = meta.seq_lens[picked], meta.block_table[picked]
        q_rows = q if tokens is None else q[tokens]
        q_nope, q_pe = q_rows.split((self.qk_nope_head_dim, self.qk_rope_head_dim), dim=-1)
        q_latent = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)  # [t, heads, kv_lora_rank]
        query = torch.cat((q_latent, q_pe), dim=-1)
        o_latent = mla_decode(query, self.kv_cache, qsl, seq_lens, table, self.scale, self.kv_lora_rank)
        o = torch.bmm(o_latent.transpose(0, 1), self.w_uv).transpose(0, 1)  # [t, heads, v]
        if tokens is None:
            out.copy_(o)
        else:
            out[tokens] = o

    def _attend(self, q: torch.Tensor, entries: torch.Tensor, expand: UpProjection) -> torch.Tensor:
        """One sequence's new queries [n, heads, qk_head_dim] (its last ``n`` positions) over its
        ``entries`` [seq_len, entry_size], causally, with the latents expanded; [n, heads, v_head_dim]."""
        seq_len, n = entries.shape[0], q.shape[0]
        latent, k_pe = entries.split((self.kv_lora_rank, self.qk_rope_head_dim), dim=-1)
        kv = expand(latent).view(seq_len, self.num_heads, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split((self.qk_nope_head_dim, self.v_head_dim), dim=-1)
        k = torch.cat((k_nope, k_pe.unsqueeze(1).expand(-1, self.num_heads, -1)), dim=-1)
        # query i sits at position seq_len - n + i and sees keys 0 .. that position
        visible = torch.arange(seq_len, device=q.device) <= torch.arange(seq_len - n, seq_len, device=q.device)[:, None]
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                           attn_mask=visible, scale=self.scale)
        return o.transpose(0, 1)


def _write(flat: torch.Tensor, slots: torch.Tensor, entries: torch.Tensor) -> None:
    """``flat[slots] = entries`` in the cache's dtype (an fp8 cache: unscaled, copied as bytes)."""
    entries = to_cache_dtype(entries, flat.dtype, 1.0)
    if flat.dtype in FP8_DTYPES:  # index_copy_ has no fp8 kernel
        flat, entries = flat.view(torch.uint8), entries.view(torch.uint8)
    flat.index_copy_(0, slots, entries)
