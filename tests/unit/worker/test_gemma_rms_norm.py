"""Gemma's RMSNorm keeps ``1 + w`` between calls; a new weight (a load or a weight sync writes it in
place; sleep and wake replace its storage) must still be the one it scales by."""

from __future__ import annotations

import pytest
import torch

from gridserve.services.worker.layers import GemmaRMSNorm


def _reference(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_scale_follows_a_weight_written_in_place_or_replaced(dtype):
    torch.manual_seed(0)
    norm = GemmaRMSNorm(16).to(dtype)
    x, residual = torch.randn(3, 16, dtype=dtype), torch.randn(3, 16, dtype=dtype)
    for _ in range(2):  # the second call reads the kept scale
        torch.testing.assert_close(norm(x), _reference(x, norm.weight))
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16, dtype=dtype))  # a weight sync: in place, same storage
    torch.testing.assert_close(norm(x), _reference(x, norm.weight))
    out, added = norm(x, residual)
    torch.testing.assert_close(out, _reference(x + residual, norm.weight))
    torch.testing.assert_close(added, x + residual)
    norm.weight = torch.nn.Parameter(torch.randn(16, dtype=dtype))  # new storage (wake from sleep)
    torch.testing.assert_close(norm(x), _reference(x, norm.weight))


def test_a_weight_made_in_inference_mode_is_read_on_every_call():
    norm = GemmaRMSNorm(8)
    x = torch.randn(2, 8)
    with torch.inference_mode():
        norm.weight = torch.nn.Parameter(torch.zeros(8), requires_grad=False)
        norm.weight.add_(0.5)  # no version counter to see this
        torch.testing.assert_close(norm(x), _reference(x, norm.weight))
        norm.weight.add_(0.25)
        torch.testing.assert_close(norm(x), _reference(x, norm.weight))
