"""The small per-token ops run on one CPU thread (no OpenMP region to stall on a shared machine),
give the same bits as on several threads, and leave the thread count as they found it."""

from __future__ import annotations

import pytest
import torch

from gridserve import kernels
from gridserve.kernels import dispatch


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_serial_ops_match_the_multithreaded_implementation_bit_for_bit(two_threads):
    """``kernels.X`` (one thread) against the op ``dispatch`` picks (the C++ kernel where it builds,
    else the reference) on two threads."""

    def impl(name):
        return dispatch._impl(name, torch.zeros(1))

    gen = torch.Generator().manual_seed(0)
    x, residual = torch.randn(256, 768, generator=gen), torch.randn(256, 768, generator=gen)
    weight = torch.randn(768, generator=gen)
    assert torch.equal(kernels.rms_norm(x, weight, 1e-6), impl("rms_norm")(x, weight, 1e-6))
    for a, b in zip(kernels.fused_add_rms_norm(x, residual, weight, 1e-6),
                    impl("fused_add_rms_norm")(x, residual, weight, 1e-6)):
        assert torch.equal(a, b)
    gate_up = torch.randn(256, 2 * 2048, generator=gen)
    assert torch.equal(kernels.silu_and_mul(gate_up), impl("silu_and_mul")(gate_up))
    q, k = torch.randn(256, 12, 64, generator=gen), torch.randn(256, 4, 64, generator=gen)
    positions = torch.randint(0, 512, (256,), generator=gen)
    cache = torch.randn(512, 64, generator=gen)
    for a, b in zip(kernels.rotary_embedding(positions, q, k, cache), impl("rotary_embedding")(positions, q, k, cache)):
        assert torch.equal(a, b)
    assert torch.get_num_threads() == 2


def test_serial_ops_run_on_one_thread_and_restore_the_count(two_threads):
    seen = []

    def probe(x):
        seen.append(torch.get_num_threads())
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        dispatch._one_thread(probe)(torch.zeros(1))
    assert seen == [1] and torch.get_num_threads() == 2
    assert "rms_norm" in dispatch.SERIAL_CPU_OPS and "paged_attention" not in dispatch.SERIAL_CPU_OPS


def test_only_decode_sized_tensors_go_to_one_thread():
    small = torch.zeros(256, 768)
    large = torch.zeros(2048, 768)  # a prefill chunk
    fn = dispatch._impl("rms_norm", small)  # the C++ kernel where it builds, else the reference
    assert dispatch._serial_impl("rms_norm", small) is dispatch._one_thread(fn)
    assert dispatch._serial_impl("rms_norm", large) is fn
