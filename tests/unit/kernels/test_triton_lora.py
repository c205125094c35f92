"""The batched multi-LoRA Triton kernels (shrink + expand over tokens grouped by slot), run on CPU in
the Triton interpreter against a plain per-token torch loop.

Shapes are tiny (the interpreter is thousands of times slower than torch) but cover mixed slots
with ``-1`` rows, one slot, slots left unused, rank not a power of two, in / out not multiples of
the tiles, split-K, strided ``y`` (a column slice of a fused projection), T = 0 and all ``-1``.
"""

from __future__ import annotations

import pytest

from tests.unit.kernels.triton_interpreter import use_triton_interpreter

use_triton_interpreter()  # before anything imports triton (the kernel modules do)

import torch  # noqa: E402

from gridserve.kernels.triton_ops import lora  # noqa: E402
from gridserve.kernels.triton_ops.lora import (  # noqa: E402
    LoraPlan,
    add_lora_triton,
    lora_segments,
)

pytestmark = pytest.mark.triton
# The interpreter truncates float32 -> bfloat16 where the GPU rounds: a couple of ulps of y.
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def reference_add_lora(y, x, lora_a, lora_b, token_slots) -> torch.Tensor:
    """The contract, one token at a time in float64: a new tensor, ``y`` is left as it is."""
    out = y.clone()
    for t, s in enumerate(token_slots.tolist()):
        if s < 0:
            continue
        delta = lora_b[s].double() @ (lora_a[s].double() @ x[t].double())
        out[t] = (y[t].double() + delta).to(y.dtype)
    return out


def make_case(slots: list[int], num_slots: int, rank: int, in_f: int, out_f: int, dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(len(slots), in_f, generator=gen).to(dtype)
    y = torch.randn(len(slots), out_f, generator=gen).to(dtype)
    lora_a = (torch.randn(num_slots, rank, in_f, generator=gen) / in_f**0.5).to(dtype)
    lora_b = (torch.randn(num_slots, out_f, rank, generator=gen) / rank**0.5).to(dtype)
    return y, x, lora_a, lora_b, torch.tensor(slots, dtype=torch.int64)


def check(slots, num_slots, rank, in_f, out_f, dtype, **kwargs):
    y, x, lora_a, lora_b, token_slots = make_case(slots, num_slots, rank, in_f, out_f, dtype)
    expected = reference_add_lora(y, x, lora_a, lora_b, token_slots)
    untouched = token_slots < 0
    y_before = y.clone()
    add_lora_triton(y, x, lora_a, lora_b, token_slots, **kwargs)
    torch.testing.assert_close(y, expected, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(y[untouched], y_before[untouched])  # bit for bit


MIXED = [2, -1, 0, 2, 1, -1, 0, 2, 2, 1, -1, 0, 2]  # interleaved, with padding rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_mixed_slots_with_padding_match_the_loop(dtype):
    check(MIXED, num_slots=3, rank=8, in_f=48, out_f=40, dtype=dtype)


@pytest.mark.parametrize(
    ("slots", "num_slots", "rank", "in_f", "out_f"),
    [
        ([1] * 7, 2, 16, 32, 24),  # one slot (slot 0 unused), a full power-of-two rank
        ([3, -1, 3, 0, 0, 3], 5, 5, 37, 71),  # rank 5 (masked to 16), odd in / out, slots 1, 2, 4 unused
        ([0], 1, 3, 10, 9),  # one decode token, everything below one tile
        ([-1] * 20 + [0] * 3 + [1] * 18, 2, 4, 20, 66),  # more padding than a tile, a segment over a tile
    ],
    ids=["one-slot", "odd-rank-and-sizes", "single-token", "long-padding"],
)
def test_shapes_match_the_loop(slots, num_slots, rank, in_f, out_f):
    check(slots, num_slots, rank, in_f, out_f, torch.float32)


def test_16_bit_tensor_core_path_fp16(monkeypatch):
    """The GPU's 16-bit branch (fp16 dot operands, the intermediate rounded to B's dtype), forced on
    CPU; only fp16: the interpreter's bfloat16 arithmetic is wrong."""
    monkeypatch.setattr(lora, "compute_in_fp32", lambda *tensors: False)
    y, x, lora_a, lora_b, token_slots = make_case(MIXED, 3, 8, 48, 40, torch.float16)
    expected = reference_add_lora(y, x, lora_a, lora_b, token_slots)
    add_lora_triton(y, x, lora_a, lora_b, token_slots)
    torch.testing.assert_close(y, expected, atol=8e-3, rtol=4e-3)  # an ulp or two of y (|y| < 8)


def test_rank_over_one_block_bf16():
    """Rank 40 with 16-wide rank blocks: the shrink's rank grid and the expand's rank loop."""
    check(MIXED[:9], 3, 40, 24, 20, torch.bfloat16,
          plan=LoraPlan(block_k=16, block_n=16, block_r=16, split_k=1))


@pytest.mark.parametrize("split_k", [2, 3])
def test_split_k_partials_add_up(split_k):
    """in = 70 over 16-wide K blocks: the last split is partial, with 3 splits one holds a single block."""
    check(MIXED, 3, 6, 70, 33, torch.float32,
          plan=LoraPlan(block_k=16, block_n=32, block_r=16, split_k=split_k))


def test_strided_y_is_updated_in_place():
    """``y`` a column slice of a fused output: the other columns keep their bits."""
    _, x, lora_a, lora_b, token_slots = make_case(MIXED, 3, 8, 32, 24, torch.float32, seed=1)
    fused = torch.randn(len(MIXED), 60)
    y = fused[:, 20:44]
    expected = reference_add_lora(y, x, lora_a, lora_b, token_slots)
    before = fused.clone()
    add_lora_triton(y, x, lora_a, lora_b, token_slots)
    torch.testing.assert_close(y, expected, atol=2e-5, rtol=2e-5)
    assert torch.equal(fused[:, :20], before[:, :20]) and torch.equal(fused[:, 44:], before[:, 44:])


def test_segments_can_be_built_once_and_reused():
    y, x, lora_a, lora_b, token_slots = make_case(MIXED, 3, 8, 24, 16, torch.float32)
    expected = reference_add_lora(y, x, lora_a, lora_b, token_slots)
    segments = lora_segments(token_slots, 3, block_m=16)
    add_lora_triton(y, x, lora_a, lora_b, token_slots, segments=segments)
    torch.testing.assert_close(y, expected, atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="segments"):
        add_lora_triton(y[:4], x[:4], lora_a, lora_b, token_slots[:4], segments=segments)


@pytest.mark.parametrize(
    "slots",
    [[0, 1, -1, 2, 2, 1, 0, 0, 2, -1, 1], [-1] * 5, [], [4, 4, 4], [0] * 9 + [-1] * 9 + [1], [0, 7, 1, 7]],
)
@pytest.mark.parametrize("block_m", [2, 4])
def test_every_slotted_token_is_in_exactly_one_tile_of_its_slot(slots, block_m):
    """The grouping alone (torch, no kernel): tiles of one slot, covering each slotted token once;
    slots >= S (7) in no tile."""
    num_slots = 5
    token_slots = torch.tensor(slots, dtype=torch.int64)
    seg = lora_segments(token_slots, num_slots, block_m=block_m)
    assert seg.prog_slot.shape[0] == len(slots) // block_m + num_slots
    order = seg.order.tolist()
    seen = []
    for slot, start, end in zip(seg.prog_slot.tolist(), seg.prog_start.tolist(), seg.prog_end.tolist()):
        assert end - start <= block_m
        for pos in range(start, end):
            assert slots[order[pos]] == slot
            seen.append(order[pos])
    assert sorted(seen) == [t for t, s in enumerate(slots) if 0 <= s < num_slots]


@pytest.mark.parametrize("slots", [[], [-1, -1, -1]], ids=["no-tokens", "all-padding"])
def test_nothing_to_add_leaves_y_alone(slots):
    y, x, lora_a, lora_b, token_slots = make_case(slots, 2, 4, 16, 8, torch.bfloat16)
    before = y.clone()
    add_lora_triton(y, x, lora_a, lora_b, token_slots)
    assert torch.equal(y, before)


def test_mismatched_shapes_are_rejected():
    y, x, lora_a, lora_b, token_slots = make_case([0, 1], 2, 4, 16, 8, torch.float32)
    with pytest.raises(ValueError):
        add_lora_triton(y, x, lora_a, lora_b.transpose(1, 2), token_slots)
    with pytest.raises(ValueError):
        add_lora_triton(y[:1], x, lora_a, lora_b, token_slots)
