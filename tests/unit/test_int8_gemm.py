"""The C++ int8 x int16 CPU GEMM against a float reference, on every instruction set this CPU runs."""

from __future__ import annotations

import pytest
import torch

from gridserve.kernels.cpu_ops import int8_gemm

ops = int8_gemm.load()
pytestmark = pytest.mark.skipif(ops is None, reason="the C++ int8 GEMM cannot be built here")
X_MAX = 32639  # the kernel's int16 range: two int8 digits


def _isas() -> list[int]:
    return list(range(int8_gemm.ISA_NAMES.index(int8_gemm.isa()) + 1)) if ops is not None else []


def _problem(m: int, n: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(n, generator=gen) * 0.01 + 1e-3
    x = torch.randn(m, k, generator=gen)
    x[:, k // 3] *= 30  # an outlier channel, as RMSNorm outputs have
    return x, q, scales


def _reference(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The dequantized activation (int16 per row) times the dequantized weight, in float64."""
    step = x.double().abs().amax(1, keepdim=True) / X_MAX
    xq = torch.round(x.double() / step).clamp(-X_MAX, X_MAX) * step
    return xq @ (q.double() * scales.double()[:, None]).T


@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize(
    "m,n,k",
    [(1, 1, 1), (1, 5, 3), (7, 130, 1001), (13, 64, 1030), (4, 70, 2051), (16, 200, 512), (1, 768, 768)],
)
def test_matches_the_dequantized_float_product(isa, m, n, k):
    """Odd shapes: one row, columns not a multiple of the 64-column group, k not a multiple of 4
    and past the 512-column block (the float carry between blocks)."""
    x, q, scales = _problem(m, n, k, seed=m * 1000 + n + k)
    y = int8_gemm.gemm(x, int8_gemm.pack(q), scales, n, isa_cap=isa)
    ref = _reference(x, q, scales)
    # An activation exactly half-way between two int16 steps may round either way: the error
    # budget is a few such steps, ~1e-6 of the largest output.
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_every_instruction_set_gives_the_same_sums():
    x, q, scales = _problem(37, 300, 1500, seed=3)
    packed = int8_gemm.pack(q)
    results = [int8_gemm.gemm(x, packed, scales, 300, isa_cap=isa) for isa in _isas()]
    for other in results[1:]:
        assert torch.equal(results[0], other)


@pytest.mark.parametrize("isa", _isas())
def test_extreme_values_do_not_overflow(isa):
    """Every product at its largest (|x| = 32639, |w| = 128) over 2048 columns: 8.6e9, past int32;
    the kernel's 512-column blocks keep each integer sum exact."""
    k, n = 2048, 64
    q = torch.full((n, k), -128, dtype=torch.int8)
    q[1::2] = 127
    x = torch.full((3, k), -2.0)
    y = int8_gemm.gemm(x, int8_gemm.pack(q), torch.ones(n), n, isa_cap=isa)
    step = 2.0 / X_MAX
    expected = torch.tensor([X_MAX * 128.0 * k, -X_MAX * 127.0 * k]).repeat(n // 2) * step
    torch.testing.assert_close(y, expected.float().expand(3, n), rtol=1e-6, atol=0)


def test_bias_zero_rows_and_the_packed_layout_round_trip():
    x, q, scales = _problem(5, 67, 9, seed=4)
    packed = int8_gemm.pack(q)
    assert packed.dtype == torch.uint8 and packed.numel() == 2 * 3 * 256  # 2 groups x 3 quads
    assert torch.equal(int8_gemm.unpack(packed, 67, 9), q)
    bias = torch.randn(67)
    y = int8_gemm.gemm(x, packed, scales, 67, bias=bias)
    torch.testing.assert_close(y, int8_gemm.gemm(x, packed, scales, 67) + bias)
    x[2] = 0  # a zero row: scale 0, output exactly the bias
    assert torch.equal(int8_gemm.gemm(x, packed, scales, 67, bias=bias)[2], bias)
    assert int8_gemm.gemm(x[:0], packed, scales, 67).shape == (0, 67)


def test_bad_inputs_are_errors_not_crashes():
    x, q, scales = _problem(2, 8, 16, seed=5)
    packed = int8_gemm.pack(q)
    with pytest.raises(RuntimeError, match="packed does not hold"):
        int8_gemm.gemm(torch.randn(2, 20), packed, scales, 8)
    with pytest.raises(RuntimeError, match="scales must be"):
        int8_gemm.gemm(x, packed, scales[:4], 8)
    with pytest.raises(RuntimeError, match="weight must be"):
        int8_gemm.pack(q.float())
