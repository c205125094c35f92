"""Attention sinks in the C++ CPU paged-attention kernel: ``SinkAttention`` on the kernel (decode
rows; longer rows stay in torch) gives the torch path's outputs, with and without a sliding window,
GQA, sinks above, below and among the scores; the kernel's own sink term against a softmax written
out; the AVX-512 and portable loops agree."""

from __future__ import annotations

import pytest
import torch

from gridserve.kernels import cpu_ops
from tests.missing_tool import missing
from tests.unit.kernels.sink_batch import BLOCK, HEADS, run_sinks, sink_layer, sink_step

CONTEXTS = [1, 16, 17, 90, 200, 33]
DECODE = [1, 1, 1, 1, 1, 1]
MIXED = [1, 9, 2, 20, 1, 4]  # prefill chunks (9, 20) take the torch path, the others the kernel


@pytest.fixture(scope="module")
def ops():
    built = cpu_ops.load()
    if built is None:
        missing("the C++ CPU extension cannot be built here (see the logged reason)")
    return built


@pytest.mark.parametrize("window", [None, 7, 16, 40])
@pytest.mark.parametrize("q_lens", [DECODE, MIXED], ids=["decode", "mixed"])
def test_sink_attention_on_the_cpu_kernel_equals_the_torch_path(ops, monkeypatch, window, q_lens):
    layer, step = sink_layer(window), sink_step(CONTEXTS, q_lens)
    kernel = run_sinks(monkeypatch, "cpu", layer, step)
    torch.testing.assert_close(kernel, run_sinks(monkeypatch, "reference", layer, step), atol=1e-5, rtol=1e-5)


def test_the_sink_joins_the_denominator_of_every_head(ops):
    """One query over a cache of one position: p = exp(s) / (exp(sink) + exp(s)), out = p * v."""
    query = torch.randn(1, HEADS, 16)
    cache = torch.randn(2, 2, BLOCK, 2, 16)
    sinks = torch.tensor([6.0, -5.0, 0.5, 1.5])
    out = torch.empty_like(query)
    qsl, lens, table = torch.tensor([0, 1]), torch.tensor([1]), torch.tensor([[1]])
    assert cpu_ops.paged_attention_short_rows(out, query, cache, qsl, lens, table, 0.25, sinks=sinks)
    k, v = cache[0, 1, 0].repeat_interleave(2, 0), cache[1, 1, 0].repeat_interleave(2, 0)  # [heads, 16]
    s = (query[0] * k).sum(-1) * 0.25
    p = torch.exp(s) / (torch.exp(sinks) + torch.exp(s))
    torch.testing.assert_close(out[0], p[:, None] * v, atol=1e-5, rtol=1e-5)


def test_the_portable_loop_and_avx512_give_the_same_sinks(ops):
    layer, step = sink_layer(24), sink_step(CONTEXTS, DECODE)
    cache, q, _, _, meta = step
    outs = []
    best = ops.paged_attention_isa(-1)
    try:
        for isa in (0, best):
            ops.paged_attention_isa(isa)
            out = torch.empty(q.shape[0], HEADS, 16)
            cpu_ops.paged_attention_short_rows(out, q.view(-1, HEADS, 16), cache, meta.query_start_loc,
                                               meta.seq_lens, meta.block_table, 0.25, sliding_window=24,
                                               sinks=layer.sinks)
            outs.append(out)
    finally:
        ops.paged_attention_isa(best)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


def test_a_sink_count_that_is_not_the_head_count_is_refused(ops):
    query, cache = torch.randn(1, HEADS, 16), torch.randn(2, 2, BLOCK, 2, 16)
    with pytest.raises(RuntimeError, match="sinks"):
        cpu_ops.paged_attention_short_rows(torch.empty_like(query), query, cache, torch.tensor([0, 1]),
                                           torch.tensor([1]), torch.tensor([[1]]), 0.25, sinks=torch.zeros(3))
