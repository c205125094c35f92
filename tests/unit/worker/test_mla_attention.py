"""``MLAAttention`` caches one latent + rope key per token and attends as plain causal attention over
the expanded keys and values would, whether a sequence arrives whole or in chunks through its blocks."""

from __future__ import annotations

import torch

from gridserve.kernels.attention_backend import AttentionMetadata
from gridserve.services.worker.mla_attention import MLAAttention

HEADS, NOPE, ROPE, V, RANK, BLOCK = 3, 8, 4, 6, 10, 4


def _inputs(tokens: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, HEADS * (NOPE + ROPE), generator=gen)
    latent, k_pe = torch.randn(tokens, RANK, generator=gen), torch.randn(tokens, ROPE, generator=gen)
    w = torch.randn(HEADS * (NOPE + V), RANK, generator=gen)
    return q, latent, k_pe, lambda x: x @ w.t()


def _meta(q_lens: list[int], seq_lens: list[int], block_table: list[list[int]]) -> AttentionMetadata:
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    slots = [table[p // BLOCK] * BLOCK + p % BLOCK for n, s, table in zip(q_lens, seq_lens, block_table)
             for p in range(s - n, s)]
    return AttentionMetadata(starts, torch.tensor(seq_lens, dtype=torch.int32),
                             torch.tensor(block_table, dtype=torch.int32), torch.tensor(slots), max(q_lens))


def _plain(q, latent, k_pe, expand, scale):
    """Causal attention over the expanded keys / values, written out."""
    t = q.shape[0]
    q = q.view(t, HEADS, NOPE + ROPE)
    k_nope, v = expand(latent).view(t, HEADS, NOPE + V).split((NOPE, V), -1)
    k = torch.cat((k_nope, k_pe[:, None].expand(-1, HEADS, -1)), -1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(t, -1)


def test_a_sequence_in_two_chunks_through_the_cache_equals_plain_causal_attention():
    layer = MLAAttention(HEADS, NOPE, ROPE, V, RANK, scale=0.3)
    layer.kv_cache = torch.zeros(layer.kv_cache_shape(8, BLOCK))
    q, latent, k_pe, expand = _inputs(11)
    table = [[5, 2, 7]]  # blocks out of order
    first = layer(q[:6], latent[:6], k_pe[:6], _meta([6], [6], table), expand)
    second = layer(q[6:], latent[6:], k_pe[6:], _meta([5], [11], table), expand)
    expected = _plain(q, latent, k_pe, expand, 0.3)
    torch.testing.assert_close(torch.cat((first, second)), expected)
    stored = layer.kv_cache[[5, 5, 5, 5, 2, 2, 2, 2, 7, 7, 7], [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2]]
    torch.testing.assert_close(stored, torch.cat((latent, k_pe), -1))  # one latent + rope key per token


def test_without_a_cache_each_sequence_attends_over_its_own_tokens():
    layer = MLAAttention(HEADS, NOPE, ROPE, V, RANK, scale=0.3)
    q, latent, k_pe, expand = _inputs(9, seed=1)
    out = layer(q, latent, k_pe, _meta([4, 5], [4, 5], [[1, 0], [2, 3]]), expand)
    torch.testing.assert_close(out[:4], _plain(q[:4], latent[:4], k_pe[:4], expand, 0.3))
    torch.testing.assert_close(out[4:], _plain(q[4:], latent[4:], k_pe[4:], expand, 0.3))


def test_the_layer_reports_the_latent_width_as_an_mla_spec():
    spec = MLAAttention(HEADS, NOPE, ROPE, V, RANK, scale=1.0).kv_cache_spec("l0", 16, 2)
    assert (spec.kind, spec.bytes_per_token, spec.kv_lora_rank, spec.qk_rope_head_dim) == ("mla", (RANK + ROPE) * 2,
                                                                                          RANK, ROPE)
