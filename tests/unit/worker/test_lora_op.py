"""``kernels.lora.add_lora`` (the torch path): every token gets its own slot's delta, tokens on no
adapter (-1) are untouched, and the one-slot fast path and the no-adapter case agree with a loop."""

from __future__ import annotations

import pytest
import torch

from gridserve.kernels.lora import add_lora, slot_groups

T, IN, OUT, R, SLOTS = 11, 24, 40, 8, 3


def _naive(y, x, a, b, slots):
    out = y.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            out[t] += b[s] @ (a[s] @ x[t])
    return out


@pytest.fixture
def tensors():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(T, OUT, generator=g), torch.randn(T, IN, generator=g),
            torch.randn(SLOTS, R, IN, generator=g), torch.randn(SLOTS, OUT, R, generator=g))


@pytest.mark.parametrize("slots", [
    [0, 0, 2, 2, 2, -1, 1, -1, 0, 1, 2],  # mixed, with base-model rows
    [1] * T,  # one adapter: the fast path
    [-1] * T,  # the base model only: nothing added
    [-1, -1, 2, -1, -1, -1, -1, -1, -1, -1, -1],
])
@pytest.mark.parametrize("grouped", [False, True])
def test_add_lora_matches_a_per_token_loop(tensors, slots, grouped):
    y, x, a, b = tensors
    token_slots = torch.tensor(slots, dtype=torch.int64)
    expected = _naive(y, x, a, b, token_slots)
    add_lora(y, x, a, b, token_slots, slot_groups(token_slots) if grouped else None)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


def test_slot_groups_fast_paths():
    assert slot_groups(torch.full((5,), 2)).groups == ((2, None),)
    assert slot_groups(torch.full((5,), -1)).groups == ()
    groups = dict(slot_groups(torch.tensor([1, -1, 0, 1])).groups)
    assert groups[1].tolist() == [0, 3] and groups[0] == (2, 3) and set(groups) == {0, 1}
    # the model runner orders requests by adapter: each slot a run of consecutive rows, no gather
    assert slot_groups(torch.tensor([-1, -1, 0, 0, 0, 3])).groups == ((0, (2, 5)), (3, (5, 6)))


def test_consecutive_and_scattered_rows_give_the_same_deltas():
    torch.manual_seed(0)
    a, b = torch.randn(4, 8, 32), torch.randn(4, 24, 8)
    slots = torch.tensor([-1, 2, 2, 2, 0, 0, 1])
    x, y = torch.randn(7, 32), torch.randn(7, 24)
    expected = y.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            expected[t] += b[s] @ (a[s] @ x[t])
    got = y.clone()
    add_lora(got, x, a, b, slots)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    perm = torch.tensor([1, 4, 0, 6, 2, 5, 3])  # the same tokens scattered: gathered rows
    got = y[perm].clone()
    add_lora(got, x[perm], a, b, slots[perm])
    torch.testing.assert_close(got, expected[perm], rtol=1e-5, atol=1e-5)
