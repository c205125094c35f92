"""Paged MLA decode (``gridserve.kernels.mla``): the torch reference against attention written out
in float64 over each sequence's entries, and the C++ CPU kernel against the reference.

Blocks are scattered over a larger cache, block-table rows are padded with the null block (noise
that must never be read), contexts cover 1, a block multiple, one past it and a few hundred tokens,
rows carry 1 to 4 new tokens, the cache is fp32, 16-bit or fp8 under fp32 / 16-bit queries.
"""

from __future__ import annotations

import pytest
import torch

from gridserve.kernels import mla
from gridserve.kernels.cpu_ops import mla as cpu_mla
from tests.missing_tool import missing

CONTEXTS = [1, 16, 17, 300, 45, 2]
Q_LENS = [1, 1, 2, 1, 4, 1]


def mla_batch(contexts, q_lens, heads=4, rank=32, rope=8, block_size=16, dtype=torch.float32, cache_dtype=None,
              seed=0):
    """(query, kv_cache, query_start_loc, seq_lens, block_table) for an absorbed MLA decode step."""
    gen = torch.Generator().manual_seed(seed + sum(contexts))
    blocks = [(c + block_size - 1) // block_size for c in contexts]
    num_blocks = sum(blocks) + 5
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(contexts), max(blocks) + 2, dtype=torch.int32)  # padded with block 0
    for i, n in enumerate(blocks):
        table[i, :n] = torch.tensor(order[:n])
        order = order[n:]
    cache = torch.randn(num_blocks, block_size, rank + rope, generator=gen).to(cache_dtype or dtype)
    qsl = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    query = (torch.randn(sum(q_lens), heads, rank + rope, generator=gen) * 0.5).to(dtype)
    return query, cache, qsl, torch.tensor(contexts, dtype=torch.int32), table


def dense_mla(query, cache, qsl, seq_lens, table, scale, rank) -> torch.Tensor:
    """Float64, one sequence and token at a time, every position read through the block table."""
    out = torch.zeros(query.shape[0], query.shape[1], rank, dtype=torch.float64)
    block_size = cache.shape[1]
    for i in range(seq_lens.shape[0]):
        ctx, a, b = int(seq_lens[i]), int(qsl[i]), int(qsl[i + 1])
        pos = torch.arange(ctx)
        entries = cache[table[i][pos // block_size].long(), pos % block_size].double()  # [ctx, entry]
        for t in range(a, b):
            seen = entries[: ctx - (b - a) + (t - a) + 1]
            probs = (query[t].double() @ seen.t() * scale).softmax(-1)  # [heads, seen]
            out[t] = probs @ seen[:, :rank]
    return out


@pytest.fixture(scope="module")
def ops():
    built = cpu_mla.load()
    if built is None:
        missing("the C++ CPU MLA decode kernel cannot be built here (see the logged reason)")
    return built


def test_reference_matches_attention_written_out():
    batch = mla_batch(CONTEXTS, Q_LENS)
    out = mla.reference_mla_decode(*batch, 0.3, 32)
    torch.testing.assert_close(out.double(), dense_mla(*batch, 0.3, 32), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("heads", "rank", "rope", "block_size"), [(4, 32, 8, 16), (16, 64, 16, 32), (3, 20, 6, 5)])
def test_cpu_kernel_matches_reference(ops, heads, rank, rope, block_size):
    batch = mla_batch(CONTEXTS, Q_LENS, heads, rank, rope, block_size)
    out = cpu_mla.mla_decode(*batch, 0.2, rank)
    torch.testing.assert_close(out, mla.reference_mla_decode(*batch, 0.2, rank), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("dtype", "cache_dtype", "tol"), [
    (torch.float32, torch.bfloat16, 1e-5), (torch.bfloat16, torch.bfloat16, 2e-2), (torch.float16, torch.float16, 2e-3),
    (torch.float32, torch.float8_e4m3fn, 1e-5), (torch.bfloat16, torch.float8_e5m2, 2e-2),
])
def test_cpu_kernel_reads_narrower_caches(ops, dtype, cache_dtype, tol):
    batch = mla_batch(CONTEXTS, Q_LENS, dtype=dtype, cache_dtype=cache_dtype)
    out = cpu_mla.mla_decode(*batch, 0.3, 32)
    assert out.dtype == dtype and out.shape == (sum(Q_LENS), 4, 32)
    torch.testing.assert_close(out.float(), mla.reference_mla_decode(*batch, 0.3, 32).float(), atol=tol, rtol=tol)


def test_one_long_sequence_splits_its_heads_over_threads_with_the_same_result(ops):
    batch = mla_batch([1000], [1], heads=8)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_mla.mla_decode(*batch, 0.3, 32)
        torch.set_num_threads(max(threads, 2))
        many = cpu_mla.mla_decode(*batch, 0.3, 32)
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(one, many, atol=0, rtol=0)  # each head's sums in one order
    torch.testing.assert_close(one, mla.reference_mla_decode(*batch, 0.3, 32), atol=1e-5, rtol=1e-5)


def test_cpu_kernel_rejects_a_block_table_past_the_cache(ops):
    query, cache, qsl, lens, table = mla_batch([20], [1])
    table[0, 1] = cache.shape[0] + 3
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_mla.mla_decode(query, cache, qsl, lens, table, 0.3, 32)


def test_dispatch_picks_the_reference_when_asked(monkeypatch):
    monkeypatch.setenv("GRIDSERVE_KERNELS", "reference")
    assert mla.implementation(torch.zeros(1, 1, 1)) is mla.reference_mla_decode
