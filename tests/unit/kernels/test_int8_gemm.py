"""The C++ int8-weight CPU GEMM against a float reference, on every instruction set this CPU runs:
int16 activations per row, and int8 activations with one scale per 32 columns ("grouped")."""

from __future__ import annotations

import pytest
import torch

from gridserve.kernels.cpu_ops import int8_gemm

ops = int8_gemm.load()
pytestmark = pytest.mark.skipif(ops is None, reason="the C++ int8 GEMM cannot be built here")
X_MAX = 32639  # the kernel's int16 range: two int8 digits
GROUP = 32  # grouped mode: input columns per activation scale


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


# ---- int8 activations, one scale per 32 columns ------------------------------------------------
def _grouped_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's grouped quantization in torch: int8 [m, kp] (k zero-padded to 32s) and scales
    [m, kp / 32]; values round(x * (127 / amax)) in float32, to nearest even; scale amax / 127."""
    m, k = x.shape
    kp = -(-k // GROUP) * GROUP
    g = torch.nn.functional.pad(x, (0, kp - k)).reshape(m, kp // GROUP, GROUP)
    amax = g.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round((g * inv).clamp(-127, 127)).to(torch.int8)
    return q.reshape(m, kp), (amax / 127.0).squeeze(-1)


@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("m,k", [(1, 1), (3, 31), (5, 33), (2, 768), (300, 1001)])
def test_grouped_quantization_matches_torch_exactly(isa, m, k):
    """Values, group scales and each row's weight-offset term (sum of scale_g * 128 * digit sum_g)."""
    x, _, _ = _problem(m, 1, k, seed=m + k)
    q, scales, offset = int8_gemm.quantize_groups(x, isa_cap=isa)
    q_ref, scales_ref = _grouped_reference(x)
    assert torch.equal(q, q_ref) and torch.equal(scales, scales_ref)
    terms = scales_ref.double() * 128 * q_ref.reshape(m, -1, GROUP).double().sum(-1)
    # a float32 sum over the groups: within a few ulps of the terms' magnitude
    assert ((offset.double() - terms.sum(-1)).abs() <= 1e-6 * terms.abs().sum(-1) + 1e-30).all()


@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize(
    "m,n,k",
    [(1, 1, 1), (1, 5, 3), (7, 130, 1001), (13, 64, 1030), (4, 70, 2051), (16, 200, 512), (1, 768, 768),
     (200, 72, 100)],
)
def test_grouped_matches_the_torch_product_of_the_same_quantization(isa, m, n, k):
    """The integer group sums are exact: the result equals sum_g scale_g (q_g . w_g) * w scale in
    float64 up to float32 accumulation. k not a multiple of 32 (a short last group), nor of 4, past
    the 512-column block; one row and many (row tiles with a remainder)."""
    x, q, scales = _problem(m, n, k, seed=m * 1000 + n + k)
    y = int8_gemm.gemm(x, int8_gemm.pack(q), scales, n, isa_cap=isa, activation_group=GROUP)
    xq, xs = _grouped_reference(x)
    x_deq = (xq.double().reshape(m, -1, GROUP) * xs.double()[..., None]).reshape(m, -1)[:, :k]
    ref = x_deq @ (q.double() * scales.double()[:, None]).T
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=2e-6 * ref.abs().max().item())


def test_grouped_every_instruction_set_gives_the_same_floats():
    """Same integer group sums and the same fma chain on every path: equal bit for bit."""
    x, q, scales = _problem(37, 300, 1500, seed=3)
    packed = int8_gemm.pack(q)
    results = [int8_gemm.gemm(x, packed, scales, 300, isa_cap=isa, activation_group=GROUP) for isa in _isas()]
    for other in results[1:]:
        assert torch.equal(results[0], other)


@pytest.mark.parametrize("isa", _isas())
def test_grouped_extreme_values_bias_and_zero_rows(isa):
    """Every product at its largest (x = -127 after scaling, w = -128 / 127) over 2048 columns; a
    zero row gives exactly the bias."""
    k, n = 2048, 64
    q = torch.full((n, k), -128, dtype=torch.int8)
    q[1::2] = 127
    x = torch.full((3, k), -2.0)
    x[1] = 0
    bias = torch.randn(n)
    y = int8_gemm.gemm(x, int8_gemm.pack(q), torch.ones(n), n, bias=bias, isa_cap=isa,
                       activation_group=GROUP)
    expected = torch.tensor([2.0 * 128 * k, -2.0 * 127 * k]).repeat(n // 2) + bias
    torch.testing.assert_close(y[0], expected, rtol=1e-6, atol=0)
    assert torch.equal(y[1], bias)


def test_bad_activation_group_is_an_error():
    x, q, scales = _problem(2, 8, 16, seed=5)
    with pytest.raises(RuntimeError, match="activation_group must be"):
        int8_gemm.gemm(x, int8_gemm.pack(q), scales, 8, activation_group=64)
