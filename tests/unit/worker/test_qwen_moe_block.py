"""Qwen2-MoE's and Qwen3-MoE's sparse blocks against transformers' own blocks on the same random
weights (router in fp32, top-k, ``norm_topk_prob``, the shared expert and its sigmoid gate), and
which layers are sparse."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from gridserve.services.worker.models.qwen_moe import (  # noqa: E402
    Qwen2MoeSparseBlock,
    QwenMoeSparseBlock,
    sparse_layers,
)
from gridserve.services.worker.parallel_state import ParallelState  # noqa: E402
from gridserve.shared.errors import ConfigError  # noqa: E402

_SIZES = {"hidden_size": 32, "moe_intermediate_size": 16, "num_experts": 8, "num_experts_per_tok": 3,
          "num_hidden_layers": 4, "num_attention_heads": 4, "vocab_size": 64, "initializer_range": 0.3}
CASES = {
    "qwen2_moe": ("Qwen2MoeConfig", "qwen2_moe", "Qwen2MoeSparseMoeBlock", Qwen2MoeSparseBlock,
                  {"shared_expert_intermediate_size": 24, "norm_topk_prob": False}),
    "qwen3_moe": ("Qwen3MoeConfig", "qwen3_moe", "Qwen3MoeSparseMoeBlock", QwenMoeSparseBlock, {"norm_topk_prob": True}),
}


def _blocks(case: str, dtype: torch.dtype):
    config_class, module, block_class, ours_class, extra = CASES[case]
    config = getattr(transformers, config_class)(**_SIZES, **extra)
    modeling = getattr(transformers.models, module)
    torch.manual_seed(0)
    theirs = getattr(getattr(modeling, f"modeling_{module}"), block_class)(config)
    for param in theirs.parameters():
        torch.nn.init.normal_(param, std=0.3)
    ours = ours_class(SimpleNamespace(**config.to_dict()), ParallelState.single())
    with torch.no_grad():
        ours.gate.weight.copy_(theirs.gate.weight)
        ours.experts.gate_up_proj.copy_(theirs.experts.gate_up_proj)
        ours.experts.down_proj.copy_(theirs.experts.down_proj)
        if ours.has_shared_expert:
            shared = theirs.shared_expert
            ours.shared_expert.gate_up_proj.weight.copy_(torch.cat([shared.gate_proj.weight, shared.up_proj.weight]))
            ours.shared_expert.down_proj.weight.copy_(shared.down_proj.weight)
            ours.shared_expert_gate.weight.copy_(theirs.shared_expert_gate.weight)
    return theirs.to(dtype).eval(), ours.to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_the_sparse_block_equals_transformers(case, dtype):
    theirs, ours = _blocks(case, dtype)
    x = torch.randn(48, _SIZES["hidden_size"]).to(dtype)
    with torch.inference_mode():
        expected = theirs(x[None])[0]
        got = ours(x)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected.float(), rtol=tolerance, atol=tolerance)


def test_mlp_only_layers_and_decoder_sparse_step_pick_the_dense_layers():
    hf = SimpleNamespace(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    assert sparse_layers(hf) == (False, True, False, False, False, True)
    assert sparse_layers(SimpleNamespace(num_hidden_layers=3)) == (True, True, True)


def test_a_sparse_step_below_one_is_refused_naming_the_field():
    with pytest.raises(ConfigError) as info:
        sparse_layers(SimpleNamespace(num_hidden_layers=2, decoder_sparse_step=0))
    assert info.value.field == "model.hf_config.decoder_sparse_step"
