"""Sliding windows, logit soft-capping and ALiBi in every CPU attention path (the torch reference,
the C++ kernel in both instruction sets, batch-invariant mode, ``PagedAttention`` with and
without a cache) against ``dense_attention`` (float64, written out independently), and the
semantics themselves against transformers' own masking, Gemma 2 and Bloom code."""

from __future__ import annotations

import pytest
import torch

from gridserve.kernels import cpu_ops, reference
from gridserve.kernels.attention_backend import AttentionMetadata
from gridserve.services.worker.attention import PagedAttention, alibi_slopes
from tests.missing_tool import missing
from tests.unit.kernels.dense_attention import dense_attention, paged_batch, upcast

DECODE_CONTEXTS = [1, 15, 16, 17, 40, 100, 333, 64]
# fresh prefills, chunked prefills onto histories longer than the windows, short rows, decodes
MIXED_CONTEXTS = [17, 40, 300, 120, 3, 50, 90]
MIXED_Q_LENS = [17, 40, 20, 7, 3, 1, 2]
SLOW = pytest.mark.slow
# 1, below / at / not a multiple of a block, a context, past all (the slow ones in the full run only)
WINDOWS = [7, 33, 4096, pytest.param(1, marks=SLOW), pytest.param(16, marks=SLOW), pytest.param(100, marks=SLOW)]
LAYOUTS = [(8, 2), pytest.param(4, 1, marks=SLOW), pytest.param(6, 6, marks=SLOW)]
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module")
def ops():
    built = cpu_ops.load()
    if built is None:
        missing("the C++ CPU extension cannot be built here (cpu_ops.load() returned None)")
    return built


IMPLEMENTATIONS = ["reference", "cpu", "cpu-portable", "batch-invariant"]


# the portable C++ loops and batch-invariant mode: every test in the full run, two here in test-fast
@pytest.fixture(params=["reference", "cpu", pytest.param("cpu-portable", marks=SLOW),
                        pytest.param("batch-invariant", marks=SLOW)])
def attend(request):
    """One CPU implementation of ``paged_attention`` with the reference's signature."""
    if request.param == "reference":
        yield reference.paged_attention
        return
    ops = request.getfixturevalue("ops")
    if request.param == "batch-invariant":
        yield lambda *args, **kw: cpu_ops.paged_attention(*args, all_rows=True, **kw)
        return
    cap = ops.paged_attention_isa(-1)
    if request.param == "cpu-portable":
        ops.paged_attention_isa(0)
    try:
        yield cpu_ops.paged_attention
    finally:
        ops.paged_attention_isa(max(cap, 1))


def check(attend, batch, scale, tol=2e-5, **mods):
    """``attend`` with the kernels' keywords against the dense answer (16-bit batches upcast)."""
    window, soft_cap, slopes = mods.get("sliding_window", 0), mods.get("soft_cap", 0.0), mods.get("alibi_slopes")
    out = attend(*batch, scale, **mods)
    assert out.dtype == batch[0].dtype and out.shape == batch[0].shape
    want = dense_attention(*upcast(batch), scale, window=window, soft_cap=soft_cap, slopes=slopes)
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize(("heads", "kv_heads"), LAYOUTS, ids=["gqa", "mqa", "mha"])
def test_sliding_window_decode(attend, window, heads, kv_heads):
    batch = paged_batch(DECODE_CONTEXTS, [1] * len(DECODE_CONTEXTS), heads, kv_heads, 64)
    check(attend, batch, 0.125, sliding_window=window)


@pytest.mark.parametrize("window", [5, 33, pytest.param(16, marks=SLOW), pytest.param(1000, marks=SLOW)])
def test_sliding_window_prefill_and_chunked_prefill_past_the_window(attend, window):
    batch = paged_batch(MIXED_CONTEXTS, MIXED_Q_LENS, 6, 2, 64)
    check(attend, batch, 0.125, sliding_window=window)


@pytest.mark.parametrize(("head_size", "block_size"), [(40, 5), pytest.param(8, 1, marks=SLOW), (64, 32)])
def test_sliding_window_any_head_and_block_size(attend, head_size, block_size):
    batch = paged_batch([1, 9, 37, 130], [1, 9, 3, 1], 4, 2, head_size, block_size)
    check(attend, batch, head_size**-0.5, sliding_window=11)


@pytest.mark.parametrize("soft_cap", [5.0, pytest.param(1.0, marks=SLOW), pytest.param(50.0, marks=SLOW)])
def test_soft_cap(attend, soft_cap):
    batch = paged_batch(MIXED_CONTEXTS, MIXED_Q_LENS, 8, 2, 64)
    check(attend, batch, 0.25, soft_cap=soft_cap)  # scores of a few units: the cap bends them


@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 8), (6, 2), pytest.param(12, 4, marks=SLOW),
                                               pytest.param(5, 1, marks=SLOW)], ids=["8", "6", "12", "5"])
def test_alibi_power_of_two_and_other_head_counts(attend, heads, kv_heads):
    batch = paged_batch(MIXED_CONTEXTS, MIXED_Q_LENS, heads, kv_heads, 32)
    check(attend, batch, 32**-0.5, alibi_slopes=alibi_slopes(heads))


@pytest.mark.parametrize("attend", IMPLEMENTATIONS, indirect=True)
def test_every_modifier_at_once_with_a_window_not_a_block_multiple(attend):
    batch = paged_batch(MIXED_CONTEXTS + [1, 17, 333], MIXED_Q_LENS + [1, 1, 1], 12, 4, 64)
    check(attend, batch, 0.125, sliding_window=21, soft_cap=3.0, alibi_slopes=alibi_slopes(12))


@pytest.mark.parametrize(("dtype", "cache_dtype"),
                         [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                          pytest.param(torch.float16, torch.float16, marks=SLOW),
                          pytest.param(torch.float32, torch.float16, marks=SLOW)],
                         ids=["bf16", "fp32-bf16-cache", "fp16", "fp32-fp16-cache"])
@pytest.mark.parametrize("attend", IMPLEMENTATIONS, indirect=True)
def test_16_bit_queries_and_caches(attend, dtype, cache_dtype):
    batch = paged_batch(MIXED_CONTEXTS, MIXED_Q_LENS, 8, 2, 64, dtype=dtype, cache_dtype=cache_dtype)
    check(attend, batch, 0.125, TOL[dtype] if dtype != torch.float32 else 2e-5,
          sliding_window=19, soft_cap=4.0, alibi_slopes=alibi_slopes(8))


def test_batch_invariant_token_results_do_not_depend_on_the_chunking(ops):
    # one 60-token sequence as a prefill, as chunks of 25 + 20 + 15 and as decodes: every token's
    # output has the same bits (the kernel reads only its window, in one order)
    query, kv_cache, _, _, table = paged_batch([60], [60], 6, 2, 64)
    mods = {"sliding_window": 13, "soft_cap": 4.0, "alibi_slopes": alibi_slopes(6)}

    def run(starts):  # sequence rows: [start, end) of the 60 tokens each, same blocks
        rows = list(zip(starts[:-1], starts[1:]))
        qsl = torch.tensor([0, *[e - s for s, e in rows]], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        lens = torch.tensor([e for _, e in rows], dtype=torch.int32)
        q = torch.cat([query[s:e] for s, e in rows])
        return cpu_ops.paged_attention(q, kv_cache, qsl, lens, table.expand(len(rows), -1).contiguous(), 0.125,
                                       all_rows=True, **mods)

    whole = run([0, 60])
    assert torch.equal(run([0, 25, 45, 60]), whole)
    assert torch.equal(run(list(range(61))), whole)


def _step(lens, heads, kv_heads, head_size, block_size=4):
    """Packed q / k / v of fresh sequences and their metadata over a fresh cache layout."""
    gen = torch.Generator().manual_seed(3)
    total = sum(lens)
    q = torch.randn(total, heads * head_size, generator=gen)
    k = torch.randn(total, kv_heads * head_size, generator=gen)
    v = torch.randn(total, kv_heads * head_size, generator=gen)
    pages = [(n + block_size - 1) // block_size for n in lens]
    table = torch.zeros(len(lens), max(pages), dtype=torch.int32)
    slots, first = [], 1
    for i, n in enumerate(pages):
        table[i, :n] = torch.arange(first, first + n)
        first += n
        slots += [int(table[i, p // block_size]) * block_size + p % block_size for p in range(lens[i])]
    qsl = torch.tensor([0, *lens]).cumsum(0).to(torch.int32)
    meta = AttentionMetadata(qsl, torch.tensor(lens, dtype=torch.int32), table, torch.tensor(slots), max(lens))
    return q, k, v, meta, torch.zeros(2, first, block_size, kv_heads, head_size)


@pytest.mark.parametrize("kernels", ["reference", "cpu"])
@pytest.mark.parametrize("mods", [{"sliding_window": 9, "logits_soft_cap": 3.0, "alibi": True},
                                  pytest.param({"sliding_window": 5}, marks=SLOW),
                                  pytest.param({"logits_soft_cap": 2.0}, marks=SLOW),
                                  pytest.param({"alibi": True}, marks=SLOW)],
                         ids=["all", "window", "cap", "alibi"])
def test_paged_attention_without_a_cache_matches_the_cached_path(monkeypatch, kernels, mods):
    monkeypatch.setenv("GRIDSERVE_KERNELS", kernels)
    heads, kv_heads, d = 6, 2, 16
    mods = dict(mods)
    if mods.pop("alibi", False):
        mods["alibi_slopes"] = alibi_slopes(heads)
    layer = PagedAttention(heads, d, kv_heads, 0.3, **mods)
    q, k, v, meta, cache = _step([40, 7, 1, 25], heads, kv_heads, d)
    profiled = layer(q, k, v, meta)  # the memory-profiling path: no cache bound
    layer.kv_cache = cache
    cached = layer(q, k, v, meta)
    torch.testing.assert_close(profiled, cached, atol=2e-6, rtol=2e-6)
    plain = PagedAttention(heads, d, kv_heads, 0.3)(q, k, v, meta)
    assert not torch.allclose(profiled, plain)  # the modifiers took effect


def test_paged_attention_refuses_bad_modifier_values():
    with pytest.raises(ValueError, match="sliding_window"):
        PagedAttention(4, 16, 2, 0.25, sliding_window=0)
    with pytest.raises(ValueError, match="logits_soft_cap"):
        PagedAttention(4, 16, 2, 0.25, logits_soft_cap=-1.0)
    with pytest.raises(ValueError, match="one slope per query head"):
        PagedAttention(4, 16, 2, 0.25, alibi_slopes=alibi_slopes(8))
    layer = PagedAttention(4, 16, 2, 0.25, alibi_slopes=alibi_slopes(8)[4:])  # a TP rank's slice
    assert layer.alibi_slopes.dtype == torch.float32


@SLOW  # imports transformers' models (seconds)
def test_alibi_slopes_are_transformers_bits():
    bloom = pytest.importorskip("transformers.models.bloom.modeling_bloom")
    for heads in range(1, 65):
        assert torch.equal(alibi_slopes(heads), bloom._get_alibi_slopes(heads, torch.device("cpu"))), heads


@SLOW  # imports transformers' models (seconds)
def test_sliding_window_and_soft_cap_are_gemma2s():
    # transformers' own mask function and Gemma 2's eager attention (soft cap) on the same q / k / v
    masking = pytest.importorskip("transformers.masking_utils")
    gemma2 = pytest.importorskip("transformers.models.gemma2.modeling_gemma2")
    heads, kv_heads, d, n, window, cap, scale = 4, 2, 32, 45, 10, 2.0, 0.2
    query, kv_cache, qsl, lens, table = paged_batch([n], [n], heads, kv_heads, d)
    idx = torch.arange(n)
    allowed = masking.sliding_window_causal_mask_function(window)(0, 0, idx[:, None], idx[None, :])
    mask = torch.zeros(n, n).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
    pos = torch.arange(n)
    blocks = table[0][pos // 16].long()
    k = kv_cache[0, blocks, pos % 16].transpose(0, 1)[None]
    v = kv_cache[1, blocks, pos % 16].transpose(0, 1)[None]
    module = torch.nn.Module()
    module.head_dim, module.num_key_value_groups, module.training = d, heads // kv_heads, False
    want, _ = gemma2.eager_attention_forward(module, query.transpose(0, 1)[None], k, v, mask, scaling=scale,
                                             softcap=cap)
    got = reference.paged_attention(query, kv_cache, qsl, lens, table, scale, sliding_window=window, soft_cap=cap)
    torch.testing.assert_close(got, want[0], atol=2e-6, rtol=2e-6)


@SLOW  # imports transformers' models (seconds)
def test_alibi_is_blooms_attention():
    # Bloom's own attention layer (alibi.baddbmm(q, k, alpha=1/sqrt(d)): the bias is not scaled)
    transformers = pytest.importorskip("transformers")
    bloom = pytest.importorskip("transformers.models.bloom.modeling_bloom")
    torch.manual_seed(0)
    config = transformers.BloomConfig(hidden_size=48, n_head=6, attn_implementation="eager")
    layer = bloom.BloomAttention(config, layer_idx=0).eval()
    n = 23
    hidden = torch.randn(1, n, 48)
    causal = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)[None, None]
    alibi = alibi_slopes(6)[:, None, None] * torch.arange(n)  # HF's slope * j, [heads, 1, n]
    with torch.no_grad():
        want = layer(hidden, torch.zeros_like(hidden), alibi, causal)[0]
        q, k, v = layer._reshape(layer.query_key_value(hidden))  # [1, heads, n, 8] each
        heads = PagedAttention(6, 8, 6, 8**-0.5, alibi_slopes=alibi_slopes(6))
        meta = AttentionMetadata(torch.tensor([0, n], dtype=torch.int32), torch.tensor([n], dtype=torch.int32),
                                 torch.zeros(1, 1, dtype=torch.int32), torch.arange(n), n)
        flat = [t[0].transpose(0, 1).reshape(n, -1) for t in (q, k, v)]
        got = layer.dense(heads(*flat, meta))
    torch.testing.assert_close(got, want[0], atol=2e-5, rtol=2e-5)
