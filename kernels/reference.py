"""Torch reference implementations of gridserve's kernels: the CPU path and the tests' ground truth.

Paged KV-cache layout (one tensor per layer)::

    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_size]   (0 = keys, 1 = values)

Attention metadata for a step holding ``num_seqs`` sequences and ``num_tokens`` packed new tokens:

    query_start_loc: [num_seqs + 1] int32   cumulative query lengths (packed layout)
    seq_lens:        [num_seqs] int32       context length of each sequence *including* new tokens
    block_table:     [num_seqs, max_blocks] int32, padded with block 0 (the null block)
    slot_mapping:    [num_tokens] int64     block_id * block_size + offset of each new token

A sequence's new tokens are its last ``q_len`` positions: causal among themselves, full attention
to the cached prefix.

Score modifiers (Hugging Face semantics; every attention path takes them as keywords, defaults off):

- ``sliding_window`` (0 = none): the query at absolute position ``i`` sees key ``j`` iff
  ``j <= i`` and ``i - j < sliding_window`` (transformers' ``sliding_window_overlay``:
  ``kv_idx > q_idx - sliding_window``; Mistral, Gemma 2/3, Qwen 2).
- ``causal`` (True unless said): False lets a query see keys on both sides (an encoder, a decoder
  embedder with bidirectional attention); a window then reaches ``|i - j| < sliding_window``
  (transformers' bidirectional window overlay of Gemma 3). Only whole sequences attend so, on the
  no-cache path (``attend_positions`` / ``query_chunks``); the paged kernels are causal.
- ``soft_cap`` (0 = none): the scaled score ``s = scale * q.k`` becomes ``soft_cap * tanh(s / soft_cap)``
  (Gemma 2's ``attn_logit_softcapping``).
- ``alibi_slopes`` ([num_heads] float, None = none): ``s += slope[head] * (j - i)`` after the scale
  and the soft cap, i.e. the bias is *not* scaled (HF Bloom's ``alibi.baddbmm(q, k, alpha=1/sqrt(d))``;
  Bloom's ``slope * j`` is the same under softmax). Falcon scales its bias with the scores: pass
  ``slopes * scale`` there. ``alibi_slopes(num_heads)`` builds HF's slopes; a tensor-parallel rank
  passes its own heads' slice.

The cache may be stored in a narrower dtype than the model computes in (``kv_cache_dtype``): 16-bit
values are cast on write and read; fp8 values hold ``key / k_scale`` and ``value / v_scale``
(per-tensor scales, saturated to the format's range) and are multiplied back when read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

_DECODE_GROUP = 16  # decode sequences per attention call
_SCORE_BUDGET = 1 << 22  # scores (heads x queries x keys) materialized at once by the modified paths
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """``x`` as stored in a cache of ``dtype``: fp8 holds ``x / scale``, saturated to its range."""
    if dtype not in FP8_DTYPES:
        return x.to(dtype)
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp_(-limit, limit).to(dtype)


def from_cache(kv: torch.Tensor, dtype: torch.dtype, k_scale: float, v_scale: float) -> torch.Tensor:
    """Gathered ``[2, ...]`` K/V in the compute ``dtype`` (fp8 values multiplied by their scale)."""
    if kv.dtype not in FP8_DTYPES:
        return kv.to(dtype)
    out = kv.to(torch.float32)
    out[0] *= k_scale
    out[1] *= v_scale
    return out.to(dtype)


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """Write packed ``key`` / ``value`` ([num_tokens, num_kv_heads, head_size]) into their slots."""
    num_blocks, block_size = kv_cache.shape[1], kv_cache.shape[2]
    flat = kv_cache.view(2, num_blocks * block_size, *kv_cache.shape[3:])
    key = to_cache_dtype(key, kv_cache.dtype, k_scale)
    value = to_cache_dtype(value, kv_cache.dtype, v_scale)
    if kv_cache.dtype in FP8_DTYPES:  # index_copy_ has no fp8 kernel: copy the bytes
        flat, key, value = flat.view(torch.uint8), key.view(torch.uint8), value.view(torch.uint8)
    flat[0].index_copy_(0, slot_mapping, key)
    flat[1].index_copy_(0, slot_mapping, value)


def _gather_kv(kv_cache: torch.Tensor, block_ids: torch.Tensor, length: int, dtype: torch.dtype,
               k_scale: float, v_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    blocks = kv_cache[:, block_ids]  # [2, n, block_size, kvh, d]
    flat = from_cache(blocks.reshape(2, -1, *kv_cache.shape[3:])[:, :length], dtype, k_scale, v_scale)
    return flat[0], flat[1]


@dataclass(frozen=True)
class ScoreMods:
    """The score modifiers of one attention call (module docstring); all off by default."""

    sliding_window: int = 0
    soft_cap: float = 0.0
    alibi_slopes: torch.Tensor | None = None  # [num_heads], float32
    causal: bool = True  # False: keys on both sides of the query (the window too)

    @property
    def plain(self) -> bool:
        """No window, soft cap or bias (causal or not: that is the attention, not a modifier)."""
        return self.sliding_window <= 0 and self.soft_cap <= 0 and self.alibi_slopes is None

    @property
    def explicit(self) -> bool:
        """Whether the scores need computing by hand (SDPA has no soft cap, and a float bias
        would be rounded to a 16-bit query's dtype)."""
        return self.soft_cap > 0 or self.alibi_slopes is not None


PLAIN = ScoreMods()


def score_mods(sliding_window: int = 0, soft_cap: float = 0.0,
               alibi_slopes: torch.Tensor | None = None, causal: bool = True) -> ScoreMods:
    """The keywords of a kernel call as one ``ScoreMods`` (slopes as float32)."""
    if alibi_slopes is not None:
        alibi_slopes = alibi_slopes.detach().to(torch.float32)
    return ScoreMods(int(sliding_window or 0), float(soft_cap or 0.0), alibi_slopes, bool(causal))


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi slopes of ``num_heads`` heads, float32 on the CPU, as HF Bloom / Falcon build them
    (``_get_alibi_slopes``): ``2^(-8 h / n)`` for the largest power of two ``n <= num_heads``,
    then every other slope of ``2n`` heads for the rest. Bit-identical to transformers."""
    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = _powers(2 ** (-(2 ** -(math.log2(closest) - 3))), range(1, 1 + closest))
    if closest != num_heads:
        extra = min(closest, num_heads - closest)
        slopes = torch.cat([slopes, _powers(2 ** (-(2 ** -(math.log2(2 * closest) - 3))), range(1, 1 + 2 * extra, 2))])
    return slopes


def _powers(base: float, exponents: range) -> torch.Tensor:
    base_t = torch.full((), base, dtype=torch.float32, device="cpu")
    return torch.pow(base_t, torch.arange(exponents.start, exponents.stop, exponents.step, dtype=torch.int32,
                                          device="cpu"))


def attend_positions(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
                     k_pos: torch.Tensor, scale: float, mods: ScoreMods) -> torch.Tensor:
    """Attention of ``q`` ([b, heads, lq, d]) over ``k`` / ``v`` ([b, kv_heads, lk, d]) whose rows
    sit at absolute positions ``q_pos`` ([b, lq]) and ``k_pos`` ([b, lk]): causal (unless
    ``mods.causal`` is False), windowed, soft-capped and biased by ``mods``. Causal: keys past a
    query's position are masked (how padding is hidden); bidirectional: every key given is one of
    the sequence's. The soft cap and ALiBi run in float32 by hand; otherwise SDPA with a boolean mask."""
    rel = k_pos[:, None, None, :] - q_pos[:, None, :, None]  # [b, 1, lq, lk]: j - i
    visible = _visible(rel, mods)
    gqa = q.shape[1] != k.shape[1]
    if not mods.explicit:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale, enable_gqa=gqa)
    group = q.shape[1] // k.shape[1]
    k, v = k.float(), v.float()
    if gqa:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = torch.matmul(q.float(), k.transpose(-1, -2)) * scale
    if mods.soft_cap > 0:
        s = torch.tanh(s / mods.soft_cap) * mods.soft_cap
    if mods.alibi_slopes is not None:
        s = s + mods.alibi_slopes.to(s.device)[None, :, None, None] * rel
    s = s.masked_fill(~visible, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v).to(q.dtype)


def _visible(rel: torch.Tensor, mods: ScoreMods) -> torch.Tensor:
    """Which keys each query sees, from ``rel = j - i``: causal, nothing ahead and, with a window,
    less than it behind; bidirectional, less than the window away either way (everything without one)."""
    reach = -rel if mods.causal else rel.abs()  # how far behind (causal) or away (bidirectional) the key is
    visible = reach >= 0
    if mods.sliding_window > 0:
        visible &= reach < mods.sliding_window
    return visible


def query_chunks(first_pos: int, q_len: int, heads: int, mods: ScoreMods):
    """``(a, b, lo, hi)`` per chunk of a sequence's queries ``[a, b)`` (positions ``first_pos + a``
    on): the keys ``[lo, hi)`` they can see (causal: up to the chunk's last query; bidirectional:
    up to the sequence's end, ``first_pos + q_len``). Chunks keep ``heads x queries x keys`` near
    ``_SCORE_BUDGET`` so a long prompt never materializes all its scores at once."""
    window, end = mods.sliding_window, first_pos + q_len
    sides = 1 if mods.causal else 2
    span = min(end, sides * window + 64) if window > 0 else end
    rows = max(16, _SCORE_BUDGET // max(heads * span, 1))
    for a in range(0, q_len, rows):
        b = min(a + rows, q_len)
        lo = max(0, first_pos + a - window + 1) if window > 0 else 0
        if mods.causal:
            hi = first_pos + b
        else:
            hi = min(end, first_pos + b + window - 1) if window > 0 else end
        yield a, b, lo, hi


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
    *,
    sliding_window: int = 0,
    soft_cap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of packed queries ([num_tokens, num_heads, head_size]) over their paged KV.

    Decode rows (one query token) are batched into a single masked call; longer rows (prefill and
    chunked prefill) run one sequence at a time. ``sliding_window``, ``soft_cap`` and
    ``alibi_slopes`` modify the scores (module docstring).
    """
    mods = score_mods(sliding_window, soft_cap, alibi_slopes)
    num_heads = query.shape[1]
    num_kv_heads = kv_cache.shape[3]
    gqa = num_heads != num_kv_heads
    out = torch.empty_like(query)
    qsl = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [qsl[i + 1] - qsl[i] for i in range(len(lens))]
    # Decode rows in groups of similar context length: one masked call per group, little padding.
    decode = sorted((i for i, n in enumerate(q_lens) if n == 1), key=lambda i: lens[i])
    for first in range(0, len(decode), _DECODE_GROUP):
        group = decode[first : first + _DECODE_GROUP]
        if mods.plain:
            _decode_batch(query, kv_cache, qsl, lens, block_table, group, scale, gqa, out, (k_scale, v_scale))
        else:
            _decode_batch_mods(query, kv_cache, qsl, lens, block_table, group, scale, out, (k_scale, v_scale), mods)
    longer = [i for i, n in enumerate(q_lens) if n > 1]
    prefill_rows(query, kv_cache, qsl, lens, block_table, longer, scale, out, (k_scale, v_scale), mods)
    return out


def prefill_rows(query, kv_cache, qsl, lens, block_table, rows, scale, out, kv_scales=(1.0, 1.0),
                 mods: ScoreMods = PLAIN) -> None:
    """Attention of the sequences ``rows`` (prefill or chunked prefill), one SDPA call each.

    ``qsl`` and ``lens`` are ``query_start_loc`` / ``seq_lens`` as lists; results go into ``out``.
    With score modifiers, each sequence runs in chunks of queries over only the keys they see.
    """
    gqa = query.shape[1] != kv_cache.shape[3]
    block_size = kv_cache.shape[2]
    for i in rows:
        start, ctx = qsl[i], lens[i]
        q_len = qsl[i + 1] - start
        if not mods.plain:
            _prefill_row_mods(query, kv_cache, block_table[i], start, q_len, ctx, scale, out, kv_scales, mods)
            continue
        blocks = block_table[i, : (ctx + block_size - 1) // block_size]
        k, v = _gather_kv(kv_cache, blocks, ctx, query.dtype, *kv_scales)
        # 4-D [1, heads, len, d]: CPU SDPA takes its fused path only for batched inputs
        q = query[start : start + q_len].transpose(0, 1).unsqueeze(0)
        k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
        if q_len == ctx:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            positions = torch.arange(ctx - q_len, ctx, device=query.device).unsqueeze(1)
            mask = torch.arange(ctx, device=query.device).unsqueeze(0) <= positions
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[start : start + q_len] = o[0].transpose(0, 1)


def _prefill_row_mods(query, kv_cache, table, start, q_len, ctx, scale, out, kv_scales, mods) -> None:
    """One sequence's new tokens with score modifiers: per chunk of queries, the blocks holding the
    keys they see (past the window's start only: a long history is never gathered whole)."""
    block_size = kv_cache.shape[2]
    device = query.device
    first_pos = ctx - q_len
    for a, b, lo, hi in query_chunks(first_pos, q_len, query.shape[1], mods):
        first_block = lo // block_size
        blocks = table[first_block : (hi + block_size - 1) // block_size]
        offset = first_block * block_size
        k, v = _gather_kv(kv_cache, blocks, hi - offset, query.dtype, *kv_scales)
        q = query[start + a : start + b].transpose(0, 1).unsqueeze(0)
        q_pos = torch.arange(first_pos + a, first_pos + b, device=device).unsqueeze(0)
        k_pos = torch.arange(offset, hi, device=device).unsqueeze(0)
        o = attend_positions(q, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), q_pos, k_pos,
                             scale, mods)
        out[start + a : start + b] = o[0].transpose(0, 1)


def _decode_batch(query, kv_cache, qsl, lens, block_table, rows, scale, gqa, out, kv_scales) -> None:
    block_size = kv_cache.shape[2]
    ctx = [lens[i] for i in rows]
    max_ctx = max(ctx)
    n_blocks = (max_ctx + block_size - 1) // block_size
    device = query.device
    idx = torch.tensor(rows, device=device)
    tables = block_table[idx, :n_blocks]  # [b, n_blocks]
    kv = kv_cache[:, tables]  # [2, b, n_blocks, block_size, kvh, d]
    kv = kv.reshape(2, len(rows), n_blocks * block_size, *kv_cache.shape[3:])[:, :, :max_ctx]
    kv = from_cache(kv, query.dtype, *kv_scales)
    k, v = kv[0].transpose(1, 2), kv[1].transpose(1, 2)  # [b, kvh, L, d]
    positions = torch.tensor([qsl[i] for i in rows], device=device)
    q = query[positions].unsqueeze(2)  # [b, h, 1, d]
    lengths = torch.tensor(ctx, device=device).unsqueeze(1)
    mask = (torch.arange(max_ctx, device=device).unsqueeze(0) < lengths)[:, None, None, :]
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    out[positions] = o.squeeze(2)


def _decode_batch_mods(query, kv_cache, qsl, lens, block_table, rows, scale, out, kv_scales, mods) -> None:
    """Decode rows with score modifiers: each row's blocks from the first its window reaches."""
    block_size = kv_cache.shape[2]
    device = query.device
    ctx = torch.tensor([lens[i] for i in rows], device=device)
    window = mods.sliding_window
    first = (ctx - window).clamp(min=0) // block_size if window > 0 else torch.zeros_like(ctx)
    n_blocks = int(((ctx + block_size - 1) // block_size - first).max())
    columns = (first[:, None] + torch.arange(n_blocks, device=device)).clamp(max=block_table.shape[1] - 1)
    tables = block_table[torch.tensor(rows, device=device)[:, None], columns]  # [b, n_blocks]
    kv = kv_cache[:, tables].reshape(2, len(rows), n_blocks * block_size, *kv_cache.shape[3:])
    kv = from_cache(kv, query.dtype, *kv_scales)
    k, v = kv[0].transpose(1, 2), kv[1].transpose(1, 2)  # [b, kvh, L, d]
    positions = torch.tensor([qsl[i] for i in rows], device=device)
    q = query[positions].unsqueeze(2)  # [b, h, 1, d]
    k_pos = first[:, None] * block_size + torch.arange(n_blocks * block_size, device=device)  # past ctx: masked
    o = attend_positions(q, k, v, (ctx - 1)[:, None], k_pos, scale, mods)
    out[positions] = o.squeeze(2)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, cast back to the input dtype before the weight (as HF Llama)."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual; return rms_norm(residual), residual``."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``query`` / ``key`` ([num_tokens, heads, head_size]) by their positions.

    ``cos_sin_cache`` is [max_position, rotary_dim] holding cos in the first half and sin in the
    second; neox style rotates the two halves of the head, GPT-J style rotates interleaved pairs.
    Dimensions past ``rotary_dim`` pass through unchanged.
    """
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)  # [t, rot/2]
    return _rotate(query, cos, sin, is_neox), _rotate(key, cos, sin, is_neox)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    rot_dim = cos.shape[-1] * 2
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    if is_neox:
        x1, x2 = x_rot.chunk(2, dim=-1)
        cos2, sin2 = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
        rotated = x_rot * cos2 + torch.cat((-x2, x1), -1) * sin2
    else:
        x1, x2 = x_rot[..., 0::2], x_rot[..., 1::2]
        rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1).flatten(-2)
    return torch.cat((rotated, x_pass), -1) if x_pass.numel() else rotated


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :d]) * x[..., d:]`` for a merged gate/up projection of width ``2 * d``."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


GELU_APPROXIMATIONS = ("none", "tanh")


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU: ``x * Phi(x)`` with the exact erf (``"none"``, HF ``gelu``) or the tanh approximation
    (``"tanh"``, HF ``gelu_pytorch_tanh`` / ``gelu_new``), as ``torch.nn.functional.gelu``."""
    check_approximate(approximate)
    return F.gelu(x, approximate=approximate)


def gelu_and_mul(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``gelu(x[..., :d], approximate) * x[..., d:]`` for a merged gate/up projection of width ``2 * d``
    (GeGLU: Gemma's MLP)."""
    check_approximate(approximate)
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate=approximate) * up


def check_approximate(approximate: str) -> None:
    if approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"gelu approximate must be one of {GELU_APPROXIMATIONS}, got {approximate!r}")
