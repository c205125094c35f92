"""The Triton paged-attention kernel's sliding window, soft cap and ALiBi (in the CPU interpreter)
against ``dense_attention`` (float64, written out independently), and its GELU kernels against
``torch.nn.functional.gelu``.

Shapes are tiny (the interpreter is thousands of times slower than torch) but cover windows
below, at and past a tile, not a block multiple, chunked prefill onto a history longer than the
window, split-K decode whose slices start at the window, GQA / MQA and 16-bit inputs.
"""

from __future__ import annotations

import pytest

from tests.unit.kernels.triton_interpreter import use_triton_interpreter

use_triton_interpreter()  # before anything imports triton (the kernel modules do)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from gridserve.kernels import dispatch, reference, triton_ops  # noqa: E402
from gridserve.kernels.triton_ops import attention  # noqa: E402
from gridserve.kernels.triton_ops.attention import AttentionPlan, run_paged_attention  # noqa: E402
from tests.unit.kernels.dense_attention import dense_attention, paged_batch, upcast  # noqa: E402

pytestmark = pytest.mark.triton
SLOW = pytest.mark.slow
# The interpreter truncates float32 -> bfloat16 where the GPU rounds: a couple of ulps.
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 3e-2}
DECODE_CONTEXTS = [1, 16, 17, 48, 100, 33]
MIXED_CONTEXTS = [17, 90, 16, 1, 40]  # fresh prefill, 8 new tokens on 82 cached, decodes, 8 on 32
MIXED_Q_LENS = [17, 8, 1, 1, 8]


def check(out, batch, scale, **mods):
    want = dense_attention(*upcast(batch), scale, window=mods.get("sliding_window", 0),
                           soft_cap=mods.get("soft_cap", 0.0), slopes=mods.get("alibi_slopes"))
    tol = TOL[batch[0].dtype]
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("window", [1, 13, 32, pytest.param(1000, marks=SLOW)])
def test_decode_sliding_window(window):
    batch = paged_batch(DECODE_CONTEXTS, [1] * 6, 8, 2, 32, 16)
    check(triton_ops.paged_attention(*batch, 0.2, 1, sliding_window=window), batch, 0.2, sliding_window=window)


@pytest.mark.parametrize("window", [5, 20, pytest.param(64, marks=SLOW)])
def test_prefill_and_chunked_prefill_past_the_window(window):
    batch = paged_batch(MIXED_CONTEXTS, MIXED_Q_LENS, 6, 2, 32, 16)  # group of 3
    check(triton_ops.paged_attention(*batch, 0.2, sliding_window=window), batch, 0.2, sliding_window=window)


def test_split_k_decode_slices_start_at_the_window():
    batch = paged_batch([300, 7, 90], [1, 1, 1], 4, 1, 32, 16)  # MQA
    mods = {"sliding_window": 70, "soft_cap": 3.0, "alibi_slopes": reference.alibi_slopes(4)}
    out = run_paged_attention(*batch, 0.2, AttentionPlan(block_m=16, tile_n=16, num_splits=3), **mods)
    check(out, batch, 0.2, **mods)


def test_soft_cap_and_alibi_of_a_non_power_of_two_head_count():
    batch = paged_batch(MIXED_CONTEXTS, MIXED_Q_LENS, 6, 3, 32, 16)
    mods = {"soft_cap": 2.0, "alibi_slopes": reference.alibi_slopes(6)}
    check(triton_ops.paged_attention(*batch, 0.25, **mods), batch, 0.25, **mods)


@pytest.mark.parametrize("dtype", [torch.bfloat16, pytest.param(torch.float16, marks=SLOW)])
def test_16_bit_inputs_with_every_modifier(dtype):
    batch = paged_batch(MIXED_CONTEXTS, MIXED_Q_LENS, 4, 2, 32, 16, dtype=dtype)
    mods = {"sliding_window": 11, "soft_cap": 4.0, "alibi_slopes": reference.alibi_slopes(4)}
    check(triton_ops.paged_attention(*batch, 0.2, **mods), batch, 0.2, **mods)


@SLOW
@pytest.mark.parametrize("plan", [AttentionPlan(16, 16), AttentionPlan(32, 64)], ids=["small", "large"])
def test_any_plan_with_a_window_that_is_not_a_tile_multiple(plan):
    batch = paged_batch(MIXED_CONTEXTS, MIXED_Q_LENS, 4, 2, 32, 16)
    out = run_paged_attention(*batch, 0.2, plan, sliding_window=21)
    check(out, batch, 0.2, sliding_window=21)


def test_a_window_bounds_the_decode_split_count(monkeypatch):
    monkeypatch.setattr(attention, "num_sms", lambda device: 64)
    query, kv_cache, _, _, table = paged_batch([4000], [1], 4, 1, 32, 16)
    assert attention.plan_attention(query, kv_cache, table, 1, 1).num_splits == 16
    assert attention.plan_attention(query, kv_cache, table, 1, 1, sliding_window=256).num_splits == 2


# --- GELU ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_and_mul_matches_torch(approximate, dtype):
    x = (torch.randn(3, 5, 2 * 40) * 3).to(dtype)
    gate, up = x.chunk(2, -1)
    want = F.gelu(gate, approximate=approximate) * up
    # bf16: the interpreter truncates where a GPU rounds, twice here (the GELU, the product)
    tol = {torch.float32: (2e-6, 1e-6), torch.bfloat16: (2e-2, 2e-2)}[dtype]
    torch.testing.assert_close(triton_ops.gelu_and_mul(x, approximate), want, atol=tol[0], rtol=tol[1])
    torch.testing.assert_close(triton_ops.gelu(x, approximate), F.gelu(x, approximate=approximate),
                               atol=tol[0], rtol=tol[1])


def test_dispatcher_sends_gelu_to_triton_when_forced(monkeypatch):
    monkeypatch.setenv("GRIDSERVE_KERNELS", "triton")
    assert dispatch._impl("gelu_and_mul", torch.ones(2)) is triton_ops.gelu_and_mul
    assert dispatch._impl("gelu", torch.ones(2)) is triton_ops.gelu
