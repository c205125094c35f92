"""Paged attention with attention sinks (gpt-oss): a learned logit per query head that joins every
softmax's denominator and carries no value.

For query ``i`` of head ``h`` over the keys ``j`` it may see (``j <= i``, and ``i - j < window`` on a
window layer)::

    p_ij = exp(s_ij) / (exp(sink_h) + sum_j exp(s_ij)),   out_i = sum_j p_ij v_j

exactly as transformers' eager gpt-oss attention (scores, sink appended, the row's max subtracted,
softmax, the sink's column dropped). The KV cache layout and the KV write are ``PagedAttention``'s
(the backend's ``write_kv``). The attention, by the kernel ``dispatch``'s rules pick
(``GRIDSERVE_KERNELS``):

- CUDA (or ``triton``): the Triton paged-attention kernel with ``sinks``, every row;
- CPU (``auto`` / ``cpu``, the C++ library built): the C++ kernel with ``sinks`` for decode rows
  (up to ``cpu_ops.MAX_KERNEL_QUERY_LEN`` new tokens), the torch path below for longer ones;
- otherwise, and in batch-invariant mode, the torch path: one sequence at a time, gathering
  through the block table only the positions the step's queries can see.

Every path honours the sliding window: the blocks before it are never read (the window KV cache
group may already have handed them back).
"""

from __future__ import annotations

import torch
from torch import nn

from gridserve.kernels import dispatch
from gridserve.kernels.attention_backend import AttentionMetadata, select_attention_backend
from gridserve.services.worker.attention import PagedAttention
from gridserve.services.worker.checkpoint import CheckpointTensor
from gridserve.shared import envs
from gridserve.shared.parallel import Shard


class SinkAttention(PagedAttention):
    """``PagedAttention`` whose softmax also counts ``sinks`` ([num_heads] of this rank's heads).

    ``heads`` is this rank's shard of the query heads: ``load`` reads only their sinks. Soft caps
    and ALiBi are not combined with sinks (no architecture asks for both).
    """

    def __init__(self, num_heads: int, head_size: int, num_kv_heads: int, scale: float, heads: Shard, *,
                 sliding_window: int | None = None) -> None:
        super().__init__(num_heads, head_size, num_kv_heads, scale, sliding_window=sliding_window)
        self.heads = heads
        self.sinks = nn.Parameter(torch.empty(num_heads))

    def load(self, param: str, tensor: CheckpointTensor, shard_id: int = 0) -> None:
        """This rank's heads' sinks out of the checkpoint's ``[total heads]``."""
        self.sinks.data.copy_(tensor.rows(self.heads.start, self.heads.end))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q = q.view(-1, self.num_heads, self.head_size)
        k = k.view(-1, self.num_kv_heads, self.head_size)
        v = v.view(-1, self.num_kv_heads, self.head_size)
        cached = self.kv_cache.numel() > 0
        if cached:
            if self.kv_cache_group:
                meta = meta.group(self.kv_cache_group)
            select_attention_backend(q, self.batch_invariant).write_kv(k, v, self.kv_cache, meta,
                                                                       self.k_scale, self.v_scale)
        kernel = self._kernel(q) if cached else None
        if kernel == "triton":
            return self._triton(q, meta).reshape(-1, self.num_heads * self.head_size)
        out = torch.empty_like(q)
        bounds = meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens.tolist()
        in_kernel = kernel == "cpu" and self._cpu_decode_rows(q, meta, out)
        for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
            if end == start or (in_kernel and end - start <= _cpu_max_query_len()):
                continue
            if cached:
                first_query = seq_lens[i] - (end - start)
                lo = self._first_visible(first_query)
                keys, values = self._gather(meta.block_table[i], lo, seq_lens[i])
            else:  # before the cache is bound: a fresh prefill over the step's own tokens
                first_query, lo = 0, 0
                keys, values = k[start:end], v[start:end]
            out[start:end] = self._attend(q[start:end], keys, values, first_query, lo)
        return out.reshape(-1, self.num_heads * self.head_size)

    def _kernel(self, q: torch.Tensor) -> str | None:
        """"triton", "cpu" or None (the torch path), by ``dispatch``'s rules."""
        mode = envs.GRIDSERVE_KERNELS
        if self.batch_invariant or mode == "reference":
            return None
        if q.is_cuda or mode == "triton":
            if dispatch._triton_ops() is not None:
                return "triton"
            if mode == "triton":
                raise RuntimeError("GRIDSERVE_KERNELS=triton but Triton cannot be imported (attention sinks)")
            return None
        if q.device.type == "cpu":
            from gridserve.kernels import cpu_ops

            if cpu_ops.load() is not None:
                return "cpu"
            if mode == "cpu":
                raise RuntimeError("GRIDSERVE_KERNELS=cpu but the C++ paged attention kernel did not build")
        return None

    def _triton(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        ops = dispatch._triton_ops()
        return ops.paged_attention(q, self.kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_table,
                                   self.scale, meta.max_query_len, self.k_scale, self.v_scale,
                                   sliding_window=self.sliding_window or 0, sinks=self.sinks)

    def _cpu_decode_rows(self, q: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor) -> bool:
        """The C++ kernel on the decode rows, into ``out``; False when it does not take the call."""
        from gridserve.kernels import cpu_ops

        return cpu_ops.paged_attention_short_rows(
            out, q, self.kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_table, self.scale,
            self.k_scale, self.v_scale, sliding_window=self.sliding_window or 0, sinks=self.sinks)

    def _first_visible(self, first_query: int) -> int:
        """The earliest position any of the step's queries (from ``first_query`` on) may see."""
        if self.sliding_window is None:
            return 0
        return max(0, first_query - self.sliding_window + 1)

    def _gather(self, block_table: torch.Tensor, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of positions ``lo .. hi - 1`` ([positions, kv_heads, head_size]) through the
        sequence's block table, read as the activations' dtype (fp8 scaled back)."""
        block_size = self.kv_cache.shape[2]
        positions = torch.arange(lo, hi, device=block_table.device)
        blocks = block_table[positions // block_size].long().to(self.kv_cache.device)
        offsets = (positions % block_size).to(self.kv_cache.device)
        keys, values = self.kv_cache[0, blocks, offsets], self.kv_cache[1, blocks, offsets]
        return self._read(keys, self.k_scale), self._read(values, self.v_scale)

    def _read(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        x = x.to(self.sinks.dtype)
        return x * scale if scale != 1.0 else x

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first_query: int,
                lo: int) -> torch.Tensor:
        """One sequence: queries at ``first_query ..`` over keys at ``lo ..``, with the sinks."""
        dtype = q.dtype
        group = self.num_heads // self.num_kv_heads
        qh = q.transpose(0, 1).float()  # [heads, n, d]
        kh = keys.transpose(0, 1).float().repeat_interleave(group, dim=0)  # [heads, m, d]
        vh = values.transpose(0, 1).float().repeat_interleave(group, dim=0)
        scores = torch.matmul(qh, kh.transpose(1, 2)) * self.scale  # [heads, n, m]
        q_pos = torch.arange(first_query, first_query + q.shape[0], device=q.device).unsqueeze(1)
        k_pos = torch.arange(lo, lo + keys.shape[0], device=q.device).unsqueeze(0)
        visible = k_pos <= q_pos
        if self.sliding_window is not None:
            visible = visible & (q_pos - k_pos < self.sliding_window)
        scores = scores.masked_fill(~visible, float("-inf"))
        sinks = self.sinks.float().view(-1, 1, 1).expand(-1, q.shape[0], 1)
        logits = torch.cat([scores, sinks], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = torch.softmax(logits, dim=-1)[..., :-1]
        return torch.matmul(probs, vh).transpose(0, 1).to(dtype)


def _cpu_max_query_len() -> int:
    """The longest row the C++ kernel computes (longer ones take the torch path)."""
    from gridserve.kernels import cpu_ops

    return cpu_ops.MAX_KERNEL_QUERY_LEN
