"""``WeightMap`` and ``load_weights`` on a hand-made two-layer module: every checkpoint layout the
zoo's models declare (renames, skipped buffers, separate Q/K/V stacked into one GEMM, a pre-fused
gate/up split per tensor-parallel rank, GPT-2's transposed Conv1D, a per-tensor rearrangement)
lands where it should, and each rank reads only its own rows."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gridserve.services.worker.checkpoint import CheckpointTensor, LoadReport
from gridserve.services.worker.parallel_layers import ColumnParallelLinear, RowParallelLinear
from gridserve.services.worker.parallel_state import ParallelState
from gridserve.services.worker.weight_loader import LLAMA_STACKED, WeightMap, load_weights
from gridserve.shared.parallel import RankLayout, even_shard

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, TP = 8, 4, 2, 2, 6, 2

WEIGHT_MAP = WeightMap(
    skip=(r"rotary_emb\.inv_freq$",),
    rename=((r"^transformer\.h\.", "model.layers."), (r"\.ln_1\.", ".input_layernorm.")),
    convert=((r"\.o_proj\.weight$", lambda t: t.flip(0)),),
    transposed=(r"\.c_fc\.weight$",),
    stacked=LLAMA_STACKED,
    fused=("gate_up_proj",),
)


class Block(nn.Module):
    """One layer of a rank: merged Q/K/V and gate/up (column-parallel), o_proj (row-parallel), a
    GPT-2 style ``c_fc`` (column-parallel, stored transposed), a replicated norm."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        heads, kv_heads = (even_shard(n * HEAD_DIM, TP, rank) for n in (HEADS, KV_HEADS))
        inter = even_shard(INTER, TP, rank)
        state = ParallelState(RankLayout(rank, TP, 1))
        self.self_attn = nn.Module()
        self.self_attn.qkv_proj = ColumnParallelLinear(HIDDEN, [heads, kv_heads, kv_heads], bias=True)
        self.self_attn.o_proj = RowParallelLinear(heads, HIDDEN, bias=False, state=state)
        self.mlp = nn.Module()
        self.mlp.gate_up_proj = ColumnParallelLinear(HIDDEN, [inter, inter], bias=False)
        self.mlp.c_fc = ColumnParallelLinear(HIDDEN, [inter], bias=False)
        self.input_layernorm = nn.Module()
        self.input_layernorm.weight = nn.Parameter(torch.empty(HIDDEN))


def _model(rank: int) -> nn.Module:
    model = nn.Module()
    model.model = nn.Module()
    model.model.layers = nn.ModuleList([Block(rank), Block(rank)])
    return model


def _checkpoint() -> dict[str, torch.Tensor]:
    """Distinct values everywhere (so a wrong row or column shows), HF-style names."""
    gen = torch.Generator().manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    for layer in (0, 1):
        p = f"transformer.h.{layer}"
        tensors |= {
            f"{p}.self_attn.q_proj.weight": torch.randn(HEADS * HEAD_DIM, HIDDEN, generator=gen),
            f"{p}.self_attn.k_proj.weight": torch.randn(KV_HEADS * HEAD_DIM, HIDDEN, generator=gen),
            f"{p}.self_attn.v_proj.weight": torch.randn(KV_HEADS * HEAD_DIM, HIDDEN, generator=gen),
            f"{p}.self_attn.q_proj.bias": torch.randn(HEADS * HEAD_DIM, generator=gen),
            f"{p}.self_attn.k_proj.bias": torch.randn(KV_HEADS * HEAD_DIM, generator=gen),
            f"{p}.self_attn.v_proj.bias": torch.randn(KV_HEADS * HEAD_DIM, generator=gen),
            f"{p}.self_attn.o_proj.weight": torch.randn(HIDDEN, HEADS * HEAD_DIM, generator=gen),
            f"{p}.self_attn.rotary_emb.inv_freq": torch.randn(HEAD_DIM // 2, generator=gen),
            f"{p}.mlp.gate_up_proj.weight": torch.randn(2 * INTER, HIDDEN, generator=gen),  # [gate; up]
            f"{p}.mlp.c_fc.weight": torch.randn(HIDDEN, INTER, generator=gen),  # Conv1D: (in, out)
            f"{p}.ln_1.weight": torch.randn(HIDDEN, generator=gen),
        }
    return tensors


def _load(rank: int, tensors: dict[str, torch.Tensor]) -> tuple[nn.Module, set[str], LoadReport]:
    model, report = _model(rank), LoadReport()
    items = ((name, CheckpointTensor(name, tuple(t.shape), t.__getitem__, report)) for name, t in tensors.items())
    return model, load_weights(model, items, WEIGHT_MAP), report


def test_target_skips_renames_and_stacks():
    assert WEIGHT_MAP.target("transformer.h.3.self_attn.rotary_emb.inv_freq") == (None, None)
    assert WEIGHT_MAP.target("transformer.h.3.ln_1.weight") == ("model.layers.3.input_layernorm.weight", None)
    assert WEIGHT_MAP.target("transformer.h.3.self_attn.k_proj.bias") == ("model.layers.3.self_attn.qkv_proj.bias", 1)
    assert WEIGHT_MAP.target("model.layers.0.mlp.up_proj.weight") == ("model.layers.0.mlp.gate_up_proj.weight", 1)
    assert WEIGHT_MAP.target("model.layers.0.mlp.gate_up_proj.weight") == ("model.layers.0.mlp.gate_up_proj.weight",
                                                                          None)


@pytest.mark.parametrize("rank", [0, 1])
def test_each_tp_rank_gets_its_rows_of_stacked_fused_and_transposed_tensors(rank):
    tensors = _checkpoint()
    model, loaded, report = _load(rank, tensors)
    q_rows, kv_rows = (HEADS * HEAD_DIM) // TP, (KV_HEADS * HEAD_DIM) // TP
    half, inter = slice(rank * q_rows, (rank + 1) * q_rows), INTER // TP
    kv_half, inter_half = slice(rank * kv_rows, (rank + 1) * kv_rows), slice(rank * inter, (rank + 1) * inter)
    for layer, block in enumerate(model.model.layers):
        p = f"transformer.h.{layer}"
        attn, mlp = block.self_attn, block.mlp
        for param in ("weight", "bias"):  # q, k, v stacked: this rank's heads of each, in that order
            expected = torch.cat([tensors[f"{p}.self_attn.q_proj.{param}"][half],
                                  tensors[f"{p}.self_attn.k_proj.{param}"][kv_half],
                                  tensors[f"{p}.self_attn.v_proj.{param}"][kv_half]])
            assert torch.equal(getattr(attn.qkv_proj, param), expected), (layer, param)
        # converted (rows flipped) before this rank took its columns
        assert torch.equal(attn.o_proj.weight, tensors[f"{p}.self_attn.o_proj.weight"].flip(0)[:, half])
        gate, up = tensors[f"{p}.mlp.gate_up_proj.weight"].split(INTER)  # pre-fused: split by full sizes
        assert torch.equal(mlp.gate_up_proj.weight, torch.cat([gate[inter_half], up[inter_half]]))
        assert torch.equal(mlp.c_fc.weight, tensors[f"{p}.mlp.c_fc.weight"].t()[inter_half])  # Conv1D transposed
        assert torch.equal(block.input_layernorm.weight, tensors[f"{p}.ln_1.weight"])  # replicated
    assert "model.layers.1.self_attn.qkv_proj.bias" in loaded and not any("inv_freq" in n for n in loaded)
    assert not any("inv_freq" in n for n in report.read), "a skipped tensor is not read"
    # a rank reads half of each sharded tensor (the converted one is read whole, then sliced)
    for name in ("transformer.h.0.mlp.gate_up_proj.weight", "transformer.h.0.mlp.c_fc.weight",
                 "transformer.h.0.self_attn.q_proj.weight"):
        assert report.fraction(name) == pytest.approx(0.5), name
    assert report.fraction("transformer.h.0.self_attn.o_proj.weight") >= 1.0


def test_a_tensor_with_no_place_is_an_error_naming_it():
    with pytest.raises(KeyError, match="transformer.h.0.attn.c_attn.weight"):
        _load(0, {"transformer.h.0.attn.c_attn.weight": torch.zeros(3, HIDDEN)})


def test_a_pre_fused_tensor_of_the_wrong_height_is_refused_naming_it():
    with pytest.raises(ValueError, match=r"gate_up_proj\.weight.*expects 12 \(6 \+ 6\)"):
        _load(0, {"transformer.h.0.mlp.gate_up_proj.weight": torch.zeros(2 * INTER + 2, HIDDEN)})


def test_place_leaves_another_stages_layers_unread():
    tensors = _checkpoint()
    model, report = _model(0), LoadReport()
    items = ((n, CheckpointTensor(n, tuple(t.shape), t.__getitem__, report)) for n, t in tensors.items())
    loaded = load_weights(model, items, WEIGHT_MAP, lambda name: None if ".layers.1." in name else name)
    assert loaded and all(".layers.0." in name for name in loaded)
    assert not any(name.startswith("transformer.h.1.") for name in report.read)
