"""The fused-MoE layer's Triton grouped GEMM (``kernels/triton_ops/moe.py``), run on CPU in the
Triton interpreter: the kernel against a float64 per-expert product, its tile table, and the
``FusedMoE`` layer under ``GRIDSERVE_KERNELS=triton`` against the same layer's torch GEMMs.

Shapes are tiny (the interpreter is thousands of times slower than torch) but cover 1, 5 and 17
tokens routed top-2 over 4 to 8 experts, experts without rows (first, middle, last), K and N that
are not multiples of the tiles, 64-row tiles, bias on and off, float32 and bfloat16.
"""

from __future__ import annotations

import pytest

from tests.unit.kernels.triton_interpreter import use_triton_interpreter

use_triton_interpreter()  # before anything imports triton (the kernel modules do)

import torch  # noqa: E402

from gridserve.kernels.triton_ops import moe  # noqa: E402
from gridserve.kernels.triton_ops.moe import moe_grouped_gemm, moe_tiles  # noqa: E402
from gridserve.services.worker.fused_moe import FusedMoE, route  # noqa: E402
from gridserve.services.worker.parallel_state import ParallelState  # noqa: E402
from gridserve.shared.parallel import RankLayout  # noqa: E402

pytestmark = pytest.mark.triton
# The interpreter truncates float32 -> bfloat16 where the GPU rounds: a couple of ulps.
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
# the layer rounds each GEMM's output and the activation to bf16 in both paths, in other orders
LAYER_TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def reference_grouped_gemm(a, weight, counts, bias) -> torch.Tensor:
    """The contract in float64, one expert's rows at a time, cast to ``a``'s dtype once."""
    out, start = [], 0
    for expert, count in enumerate(counts.tolist()):
        rows = a[start : start + count].double() @ weight[expert].double().t()
        out.append(rows if bias is None else rows + bias[expert].double())
        start += count
    return torch.cat(out).to(a.dtype)


def make_case(counts: list[int], n: int, k: int, dtype, bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(sum(counts), k, generator=gen).to(dtype)
    weight = (torch.randn(len(counts), n, k, generator=gen) / k**0.5).to(dtype)
    b = torch.randn(len(counts), n, generator=gen).to(dtype) if bias else None
    return a, weight, torch.tensor(counts, dtype=torch.int64), b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("counts", [
    [0, 1, 0, 1],                         # one token, top-2 over 4 experts
    [1, 0, 3, 0, 2, 4],                   # 5 tokens x 2, experts without rows in between
    [0, 5, 9, 1, 0, 7, 12, 0],            # 17 tokens x 2 over 8 experts, first and last empty
])
def test_grouped_gemm_equals_a_per_expert_product(counts, bias, dtype):
    a, weight, counts_t, b = make_case(counts, n=40, k=48, dtype=dtype, bias=bias)  # N, K: partial tiles
    got = moe_grouped_gemm(a, weight, counts_t, b)
    assert got.dtype == dtype and got.shape == (a.shape[0], 40)
    torch.testing.assert_close(got, reference_grouped_gemm(a, weight, counts_t, b), atol=TOL[dtype],
                               rtol=TOL[dtype])


def test_64_row_tiles_and_a_strided_weight():
    """Prefill-sized tiles (one expert spanning several of them) and a transposed weight view."""
    a, weight, counts, b = make_case([70, 0, 3, 60], n=24, k=32, dtype=torch.float32, bias=True, seed=3)
    weight_t = weight.transpose(1, 2).contiguous().transpose(1, 2)  # same values, strides (n*k, 1, n)
    tiles = moe_tiles(counts, a.shape[0], block_m=64)
    got = moe_grouped_gemm(a, weight_t, counts, b, tiles=tiles)
    torch.testing.assert_close(got, reference_grouped_gemm(a, weight, counts, b), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("block_m", [16, 64])
def test_each_row_lies_in_exactly_one_tile_of_its_expert(block_m):
    gen = torch.Generator().manual_seed(5)
    for num_experts in (1, 4, 8, 33):
        counts = torch.randint(0, 3 * block_m, (num_experts,), generator=gen)
        counts[torch.randint(0, num_experts, (num_experts // 3,), generator=gen)] = 0  # some experts idle
        rows = int(counts.sum())
        tiles = moe_tiles(counts, rows, block_m)
        assert tiles.tile_expert.shape[0] == rows // block_m + num_experts
        owner = torch.full((rows,), -1)
        for expert, start, end in zip(tiles.tile_expert.tolist(), tiles.tile_start.tolist(),
                                      tiles.tile_end.tolist(), strict=True):
            if start >= end:
                continue
            assert end - start <= block_m and (owner[start:end] == -1).all()
            owner[start:end] = expert
        assert torch.equal(owner, torch.repeat_interleave(torch.arange(num_experts), counts))


def test_bad_shapes_name_the_argument():
    a, weight, counts, b = make_case([1, 2], n=8, k=16, dtype=torch.float32, bias=True)
    with pytest.raises(ValueError, match="weight"):
        moe_grouped_gemm(a[:, :8], weight, counts, b)
    with pytest.raises(ValueError, match="counts"):
        moe_grouped_gemm(a, weight, counts[:1], b)
    with pytest.raises(ValueError, match="bias"):
        moe_grouped_gemm(a, weight, counts, b[:, :4])


# ---- the layer: GRIDSERVE_KERNELS=triton against the same layer's torch GEMMs

def _layer(num_experts: int, hidden: int, inter: int, dtype, bias: bool, seed: int = 0) -> FusedMoE:
    gen = torch.Generator().manual_seed(seed)
    layer = FusedMoE(num_experts, hidden, inter, ParallelState(RankLayout(0, 1, 1)), bias=bias)
    layer.gate_up_proj.data.copy_(torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5)
    layer.down_proj.data.copy_(torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5)
    if bias:
        layer.gate_up_bias.data.copy_(torch.randn(num_experts, 2 * inter, generator=gen))
        layer.down_bias.data.copy_(torch.randn(num_experts, hidden, generator=gen))
    return layer.to(dtype)


def _routed(tokens: int, num_experts: int, hidden: int, dtype, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, num_experts, generator=gen)
    logits[:, -1] = -1e4  # the last expert never chosen: a group without rows
    weights, ids = route(logits, 2)
    return torch.randn(tokens, hidden, generator=gen).to(dtype), weights, ids


@pytest.fixture
def spy(monkeypatch):
    """Counts the layer's calls of the Triton grouped GEMM."""
    calls = []
    kernel = moe.moe_grouped_gemm

    def counted(*args, **kwargs):
        calls.append(args[1].shape)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(moe, "moe_grouped_gemm", counted)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "num_experts", "hidden", "inter", "bias"), [
    (1, 4, 32, 32, False),
    (5, 6, 64, 48, True),
    (17, 8, 48, 64, False),
])
def test_the_layer_runs_the_triton_gemm_under_gridserve_kernels_triton(
        monkeypatch, spy, tokens, num_experts, hidden, inter, bias, dtype):
    layer = _layer(num_experts, hidden, inter, dtype, bias)
    x, weights, ids = _routed(tokens, num_experts, hidden, dtype)
    monkeypatch.setenv("GRIDSERVE_KERNELS", "reference")
    expected = layer(x, weights, ids)
    assert spy == []  # reference: the torch GEMMs
    monkeypatch.setenv("GRIDSERVE_KERNELS", "triton")
    got = layer(x, weights, ids)
    assert spy == [layer.gate_up_proj.shape, layer.down_proj.shape]  # both projections, once each
    assert got.dtype == dtype
    torch.testing.assert_close(got, expected, atol=LAYER_TOL[dtype], rtol=LAYER_TOL[dtype])


def test_cpu_tensors_under_auto_keep_the_torch_gemms(monkeypatch, spy):
    layer = _layer(4, 32, 32, torch.float32, bias=False)
    monkeypatch.setenv("GRIDSERVE_KERNELS", "auto")
    layer(*_routed(3, 4, 32, torch.float32))
    assert spy == []


def test_int8_experts_keep_their_own_path_under_gridserve_kernels_triton(monkeypatch, spy):
    layer = _layer(4, 64, 32, torch.float32, bias=False)
    x, weights, ids = _routed(5, 4, 64, torch.float32)
    monkeypatch.setenv("GRIDSERVE_KERNELS", "triton")
    float_out = layer(x, weights, ids)
    spy.clear()
    layer.quantize("int8")
    quantized_out = layer(x, weights, ids)
    assert spy == []
    torch.testing.assert_close(quantized_out, float_out, atol=0.05, rtol=0.05)  # int8 weights' rounding
