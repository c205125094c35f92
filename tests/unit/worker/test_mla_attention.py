"""``MLAAttention`` caches one latent + rope key per token and attends as plain causal attention over
the expanded keys and values would, whether a sequence arrives whole or in chunks through its blocks;
decode rows with the absorbed ``W_uk`` / ``W_uv`` give the expand path's result (fp32 tolerance)."""

from __future__ import annotations

import pytest
import torch

from gridserve.kernels import mla
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


# --- decode-time weight absorption ---------------------------------------------------------------
# Several sequences of different lengths (one token, a block boundary, one past it, a long one),
# blocks scattered over the cache, block-table rows padded with the null block 0, whose contents
# are noise that must never be read.
CONTEXTS = [1, 4, 5, 23, 37]
Q_LENS = [1, 1, 3, 1, 2]  # a few rows with several new tokens (speculative verification)


def _decode_step(layer: MLAAttention, seed: int = 3):
    """A filled cache and a decode step over it: (q, latent, k_pe, meta) of the step's new tokens."""
    gen = torch.Generator().manual_seed(seed)
    blocks = [(c + BLOCK - 1) // BLOCK for c in CONTEXTS]
    num_blocks = sum(blocks) + 4
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(CONTEXTS), max(blocks) + 2, dtype=torch.int32)  # padded with the null block
    for i, n in enumerate(blocks):
        table[i, :n] = torch.tensor(order[:n])
        order = order[n:]
    layer.kv_cache = torch.randn(layer.kv_cache_shape(num_blocks, BLOCK), generator=gen)
    tokens = sum(Q_LENS)
    q = torch.randn(tokens, HEADS * (NOPE + ROPE), generator=gen)
    latent, k_pe = torch.randn(tokens, RANK, generator=gen), torch.randn(tokens, ROPE, generator=gen)
    return q, latent, k_pe, _meta(Q_LENS, CONTEXTS, table.tolist())


def _kv_b_proj(seed: int = 4) -> torch.nn.Linear:
    layer = torch.nn.Linear(RANK, HEADS * (NOPE + V), bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=torch.Generator().manual_seed(seed)))
    return layer


def _expanded(layer: MLAAttention, cache: torch.Tensor, step, kv_b_proj) -> torch.Tensor:
    """The same step through the expand path (batch-invariant mode expands every row)."""
    twin = MLAAttention(HEADS, NOPE, ROPE, V, RANK, scale=layer.scale)
    twin.batch_invariant = True
    twin.kv_cache = cache.clone()
    return twin(*step, kv_b_proj)


@pytest.mark.parametrize("kernels", ["reference", "auto"])
def test_absorbed_decode_equals_expanded_decode(monkeypatch, kernels):
    monkeypatch.setenv("GRIDSERVE_KERNELS", kernels)
    layer = MLAAttention(HEADS, NOPE, ROPE, V, RANK, scale=0.3)
    step = _decode_step(layer)
    cache, kv_b_proj = layer.kv_cache.clone(), _kv_b_proj()
    absorbed = layer(*step, kv_b_proj)
    assert mla.implementation(step[0]).__module__.endswith("cpu_ops.mla" if kernels == "auto" else "kernels.mla")
    assert layer.absorbs and layer.w_uk.shape == (HEADS, NOPE, RANK) and layer.w_uv.shape == (HEADS, RANK, V)
    torch.testing.assert_close(absorbed, _expanded(layer, cache, step, kv_b_proj), atol=1e-5, rtol=1e-5)


def test_a_step_mixing_decode_and_prefill_rows_absorbs_only_the_short_ones():
    layer = MLAAttention(HEADS, NOPE, ROPE, V, RANK, scale=0.3)
    q, latent, k_pe, _ = _decode_step(layer)
    # row 2 becomes a chunk of 6 new tokens (expands); the others stay decode rows (absorb)
    q_lens = [1, 1, 6, 1, 2]
    extra = torch.Generator().manual_seed(9)
    q = torch.cat((q[:2], torch.randn(6, q.shape[1], generator=extra), q[5:]))
    latent = torch.cat((latent[:2], torch.randn(6, RANK, generator=extra), latent[5:]))
    k_pe = torch.cat((k_pe[:2], torch.randn(6, ROPE, generator=extra), k_pe[5:]))
    table = torch.zeros(5, 12, dtype=torch.int32)
    table[:, :10] = torch.arange(1, 51).view(5, 10)
    layer.kv_cache = torch.randn(layer.kv_cache_shape(51, BLOCK), generator=extra)
    step = (q, latent, k_pe, _meta(q_lens, [1, 4, 8, 23, 37], table.tolist()))
    cache, kv_b_proj = layer.kv_cache.clone(), _kv_b_proj()
    torch.testing.assert_close(layer(*step, kv_b_proj), _expanded(layer, cache, step, kv_b_proj),
                               atol=1e-5, rtol=1e-5)


def test_absorbed_weights_come_from_an_int8_kv_b_proj_dequantized():
    from gridserve.services.worker.parallel_layers import ColumnParallelLinear
    from gridserve.shared.parallel import Shard

    kv_b_proj = ColumnParallelLinear(RANK, [Shard(0, HEADS * (NOPE + V), HEADS * (NOPE + V))], bias=False)
    with torch.no_grad():
        kv_b_proj.weight.copy_(_kv_b_proj().weight)
    kv_b_proj.quantize("int8", activations=False)  # weight-only: expand multiplies by the same values
    assert kv_b_proj.weight is None
    layer = MLAAttention(HEADS, NOPE, ROPE, V, RANK, scale=0.3)
    step = _decode_step(layer)
    cache = layer.kv_cache.clone()
    absorbed = layer(*step, kv_b_proj)
    dequantized = kv_b_proj.qweight.dequantize().view(HEADS, NOPE + V, RANK)
    torch.testing.assert_close(layer.w_uk, dequantized[:, :NOPE])
    torch.testing.assert_close(absorbed, _expanded(layer, cache, step, kv_b_proj), atol=1e-4, rtol=1e-4)


def test_new_weights_are_split_again_after_weights_changed():
    layer = MLAAttention(HEADS, NOPE, ROPE, V, RANK, scale=0.3)
    step = _decode_step(layer)
    cache, kv_b_proj = layer.kv_cache.clone(), _kv_b_proj()
    layer(*step, kv_b_proj)
    with torch.no_grad():
        kv_b_proj.weight.mul_(-0.5)  # a weight sync's in-place copy
    layer.weights_changed()
    layer.kv_cache = cache.clone()
    torch.testing.assert_close(layer(*step, kv_b_proj), _expanded(layer, cache, step, kv_b_proj),
                               atol=1e-5, rtol=1e-5)


def test_a_kv_b_proj_with_a_lora_attachment_is_never_absorbed():
    layer = MLAAttention(HEADS, NOPE, ROPE, V, RANK, scale=0.3)
    step = _decode_step(layer)
    kv_b_proj = _kv_b_proj()
    kv_b_proj.lora = object()  # the adapter's delta lives outside the weight
    out = layer(*step, kv_b_proj)
    assert not layer.absorbs and out.shape == (sum(Q_LENS), HEADS * V)
    layer.weights_changed()
    layer.absorb(kv_b_proj, torch.float32)
    assert not layer.absorbs
