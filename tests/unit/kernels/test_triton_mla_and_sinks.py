"""In the CPU interpreter: the Triton paged MLA decode kernel against the torch reference (scattered
blocks, null-block padding, rows of 1-4 new tokens, head counts below and above a head block,
latent / rope widths that are not powers of two, 16-bit and fp8 caches); ``SinkAttention`` on the
Triton paged-attention kernel with sinks against its torch path (decode, split-K decode, prefill
and chunked prefill, with and without a window)."""

from __future__ import annotations

import pytest

from tests.unit.kernels.triton_interpreter import use_triton_interpreter

use_triton_interpreter()  # before anything imports triton (the kernel modules do)

import torch  # noqa: E402

from gridserve.kernels import mla, triton_ops  # noqa: E402
from gridserve.kernels.triton_ops import attention  # noqa: E402
from tests.unit.kernels.sink_batch import run_sinks, sink_layer, sink_step  # noqa: E402
from tests.unit.kernels.test_mla_decode import CONTEXTS, Q_LENS, mla_batch  # noqa: E402

pytestmark = pytest.mark.triton


@pytest.mark.parametrize(("heads", "rank", "rope", "block_size"), [(4, 32, 8, 16), (20, 24, 6, 5)])
def test_triton_mla_decode_matches_reference(heads, rank, rope, block_size):
    batch = mla_batch(CONTEXTS, Q_LENS, heads, rank, rope, block_size)
    out = triton_ops.mla_decode(*batch, 0.2, rank)
    torch.testing.assert_close(out, mla.reference_mla_decode(*batch, 0.2, rank), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(("dtype", "cache_dtype", "tol"), [
    (torch.bfloat16, torch.bfloat16, 3e-2), (torch.float32, torch.float8_e4m3fn, 2e-5),
])
def test_triton_mla_decode_reads_narrower_caches(dtype, cache_dtype, tol):
    batch = mla_batch([1, 40, 17], [1, 2, 1], dtype=dtype, cache_dtype=cache_dtype)
    out = triton_ops.mla_decode(*batch, 0.3, 32)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), mla.reference_mla_decode(*batch, 0.3, 32).float(), atol=tol, rtol=tol)


def test_dispatch_picks_triton_when_forced(monkeypatch):
    monkeypatch.setenv("GRIDSERVE_KERNELS", "triton")
    assert mla.implementation(torch.zeros(1, 1, 1)) is triton_ops.mla_decode


@pytest.mark.parametrize("window", [None, 13])
@pytest.mark.parametrize("q_lens", [[1, 1, 1, 1], [5, 1, 17, 3]], ids=["decode", "mixed"])
def test_sink_attention_on_triton_equals_the_torch_path(monkeypatch, window, q_lens):
    layer, step = sink_layer(window), sink_step([9, 40, 17, 70], q_lens)
    triton = run_sinks(monkeypatch, "triton", layer, step)
    torch.testing.assert_close(triton, run_sinks(monkeypatch, "reference", layer, step), atol=2e-5, rtol=2e-5)


def test_split_k_decode_adds_the_sink_once_in_the_reduction(monkeypatch):
    real_plan = attention.plan_attention
    monkeypatch.setattr(attention, "plan_attention", lambda *a, **k: attention.AttentionPlan(
        block_m=16, tile_n=16, num_splits=3) if real_plan(*a, **k).num_splits == 1 else real_plan(*a, **k))
    layer, step = sink_layer(None), sink_step([300, 7, 90], [1, 1, 1])
    triton = run_sinks(monkeypatch, "triton", layer, step)
    torch.testing.assert_close(triton, run_sinks(monkeypatch, "reference", layer, step), atol=2e-5, rtol=2e-5)
