"""GELU and GELU-and-mul (GeGLU): the torch reference, the C++ CPU kernel (AVX-512 and portable
loops) and ``gridserve.kernels``' dispatch against ``torch.nn.functional.gelu`` and float64 truth.

torch's own float32 GELU is off by up to ~1e-6 absolute (its vectorized erf is a 1.5e-7
polynomial, and ``1 + erf`` cancels for negative inputs); the C++ kernel computes
``0.5 x erfc(-x / sqrt 2)`` instead, so it is compared with torch at that absolute floor and with
float64 truth at 1e-6 relative, plus, for negative inputs, what rounding the input to float32
alone costs there (the tail's slope: ~1e-7 x^2).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gridserve import kernels
from gridserve.kernels import cpu_ops, dispatch, reference
from tests.missing_tool import missing

APPROXIMATIONS = ["none", "tanh"]


@pytest.fixture(scope="module")
def ops():
    built = cpu_ops.load_layer_ops()
    if built is None:
        missing("the C++ CPU layer ops cannot be built here (cpu_ops.load_layer_ops() returned None)")
    return built


@pytest.fixture(params=["avx512", "portable"])
def isa(request, ops):
    if request.param == "avx512" and ops.layer_ops_isa() < 1:
        pytest.skip("no AVX-512 here")
    before = ops.layer_ops_isa()
    ops.layer_ops_isa(1 if request.param == "avx512" else 0)
    yield request.param
    ops.layer_ops_isa(max(before, 1))


def inputs(*shape, dtype=torch.float32, seed=0):
    """Normal values times 4 plus the hard spots: 0, tiny, +-1 / +-2 edges (erf's ranges for x / sqrt 2),
    far tails (under- and overflow of the exponentials)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen) * 4
    special = torch.tensor([0.0, 1e-8, -1e-8, 1.4142, -1.4142, 1.4143, -1.4143, 2.8284, -2.8285, -8.0, -12.0,
                            -30.0, 30.0, -200.0, 200.0, 0.625, -0.7])
    x.view(-1)[: special.numel()] = special
    return x.to(dtype)


def truth(x: torch.Tensor, approximate: str) -> torch.Tensor:
    """GELU in float64 without the cancellation of ``1 + erf`` / ``1 + tanh`` (which F.gelu has
    even in float64 below x ~ -8): ``0.5 x erfc(-x / sqrt 2)``, ``x sigmoid(2u)``."""
    x = x.double()
    if approximate == "tanh":
        return x * torch.sigmoid(2 * 0.7978845608028654 * (x + 0.044715 * x**3))
    return 0.5 * x * torch.special.erfc(-x * 0.7071067811865476)


def assert_accurate(got: torch.Tensor, x: torch.Tensor, want: torch.Tensor) -> None:
    """|got - want| <= (1e-6 + 3e-7 x^2 for x < 0) |want|, or underflow (|want| < 1e-36)."""
    x = x.double()
    tol = (1e-6 + 3e-7 * torch.where(x < 0, x * x, torch.zeros_like(x))) * want.abs() + 1e-36
    diff = (got.double() - want).abs()
    assert bool((diff <= tol).all()), f"worst {(diff / tol).max().item():.3g} x the tolerance"


@pytest.mark.parametrize("approximate", APPROXIMATIONS)
@pytest.mark.parametrize(("tokens", "d"), [(1, 16), (7, 40), (64, 2048)])
def test_gelu_and_mul_float32(isa, approximate, tokens, d):
    x = inputs(tokens, 2 * d, seed=d)
    gate, up = x.chunk(2, -1)
    got = cpu_ops.gelu_and_mul(x, approximate)
    torch.testing.assert_close(got, reference.gelu_and_mul(x, approximate), atol=2e-6 * 16, rtol=1e-6)
    exact = truth(gate, approximate) * up.double()
    assert_accurate(got, gate, exact)


@pytest.mark.parametrize("approximate", APPROXIMATIONS)
def test_gelu_float32(isa, approximate):
    x = inputs(9, 333, seed=3)
    got = cpu_ops.gelu(x, approximate)
    torch.testing.assert_close(got, F.gelu(x, approximate=approximate), atol=2e-6, rtol=1e-6)
    assert_accurate(got, x, truth(x, approximate))


@pytest.mark.parametrize("approximate", APPROXIMATIONS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_rounds_the_gelu_before_the_product_as_torch_does(isa, approximate, dtype):
    x = inputs(5, 2 * 72, dtype=dtype, seed=5)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(cpu_ops.gelu_and_mul(x, approximate), reference.gelu_and_mul(x, approximate),
                               atol=1e-5, rtol=2 * eps)
    torch.testing.assert_close(cpu_ops.gelu(x, approximate), F.gelu(x, approximate=approximate),
                               atol=1e-5, rtol=2 * eps)


def test_gelu_and_mul_takes_3d_and_strided_rows(isa):
    base = inputs(3, 4, 100, seed=7)
    x = base[..., :96]  # rows strided by 100
    torch.testing.assert_close(cpu_ops.gelu_and_mul(x), reference.gelu_and_mul(x), atol=3e-5, rtol=1e-6)
    assert cpu_ops.gelu_and_mul(x).shape == (3, 4, 48)


def test_a_row_alone_has_the_bits_it_has_in_a_batch(ops):
    x = inputs(300, 2 * 512, seed=8)
    batch = cpu_ops.gelu_and_mul(x, "tanh")
    assert torch.equal(cpu_ops.gelu_and_mul(x[17:18], "tanh"), batch[17:18])


def test_unknown_approximation_is_refused():
    x = torch.randn(2, 8)
    for fn in (reference.gelu, reference.gelu_and_mul, cpu_ops.gelu, cpu_ops.gelu_and_mul, kernels.gelu_and_mul):
        with pytest.raises(ValueError, match="approximate"):
            fn(x, "erf")


def test_dispatch_runs_the_cpu_kernel_and_matches(monkeypatch, ops):
    monkeypatch.setenv("GRIDSERVE_KERNELS", "cpu")
    assert dispatch._impl("gelu_and_mul", torch.ones(2)) is cpu_ops.gelu_and_mul
    assert dispatch._impl("gelu", torch.ones(2)) is cpu_ops.gelu
    x = inputs(4, 64)
    torch.testing.assert_close(kernels.gelu_and_mul(x, approximate="tanh"), reference.gelu_and_mul(x, "tanh"),
                               atol=3e-5, rtol=1e-6)
    torch.testing.assert_close(kernels.gelu(x), F.gelu(x), atol=2e-6, rtol=1e-6)
    monkeypatch.setenv("GRIDSERVE_KERNELS", "reference")
    assert dispatch._impl("gelu_and_mul", torch.ones(2)) is reference.gelu_and_mul
