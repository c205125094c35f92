"""A paged step for ``SinkAttention``: a filled cache (blocks scattered, rows padded with the null
block), the step's new q / k / v and its metadata, and the layer's outputs under a kernels mode."""

from __future__ import annotations

import torch

from gridserve.kernels.attention_backend import AttentionMetadata
from gridserve.services.worker.sink_attention import SinkAttention
from gridserve.shared.parallel import Shard

HEADS, KV_HEADS, HEAD_SIZE, BLOCK = 4, 2, 16, 16


def sink_layer(window: int | None, seed: int = 0) -> SinkAttention:
    layer = SinkAttention(HEADS, HEAD_SIZE, KV_HEADS, 0.25, Shard(0, HEADS, HEADS), sliding_window=window)
    with torch.no_grad():  # one sink far above the scores, one far below, two among them
        layer.sinks.copy_(torch.tensor([6.0, -5.0, 0.5, 1.5]))
    return layer


def sink_step(contexts: list[int], q_lens: list[int], num_blocks: int | None = None, seed: int = 0):
    """(cache, q, k, v, meta): the cache holds noise everywhere, the new tokens go to their slots."""
    gen = torch.Generator().manual_seed(seed + sum(contexts))
    blocks = [(c + BLOCK - 1) // BLOCK for c in contexts]
    num_blocks = num_blocks or sum(blocks) + 3
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(contexts), max(blocks) + 1, dtype=torch.int32)
    for i, n in enumerate(blocks):
        table[i, :n] = torch.tensor(order[:n])
        order = order[n:]
    cache = torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_SIZE, generator=gen)
    tokens = sum(q_lens)
    q = torch.randn(tokens, HEADS * HEAD_SIZE, generator=gen)
    k, v = (torch.randn(tokens, KV_HEADS * HEAD_SIZE, generator=gen) for _ in range(2))
    slots = [int(table[i, p // BLOCK]) * BLOCK + p % BLOCK for i, (n, c) in enumerate(zip(q_lens, contexts))
             for p in range(c - n, c)]
    qsl = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    meta = AttentionMetadata(qsl, torch.tensor(contexts, dtype=torch.int32), table, torch.tensor(slots),
                             max(q_lens))
    return cache, q, k, v, meta


def run_sinks(monkeypatch, kernels: str, layer: SinkAttention, step) -> torch.Tensor:
    """The layer's output for ``step`` with ``GRIDSERVE_KERNELS=kernels``, over a copy of its cache."""
    cache, q, k, v, meta = step
    monkeypatch.setenv("GRIDSERVE_KERNELS", kernels)
    layer.kv_cache = cache.clone()
    return layer(q, k, v, meta)
