"""``bench zoo-step``'s arithmetic: the weights a token multiplies, counted by hand on tiny configs
(untied, tied, learned positions, a MoE's active experts), the FLOPs of a step, the ratio to
Llama's, and that every text architecture of the registry has a checkpoint in the shape family."""

from __future__ import annotations

import pytest

from gridserve.benchmarks import zoo_step
from gridserve.shared.model_registry import ARCHITECTURES

transformers = pytest.importorskip("transformers")

# hidden 8, intermediate 16, 2 layers, 2 heads / 1 KV head of 4, vocab 10
_LLAMA = {"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
          "num_key_value_heads": 1, "head_dim": 4, "vocab_size": 10}
# per layer: Q 8x8, K and V 8x4 each, O 8x8, gate / up / down 8x16 each
_LLAMA_LAYER = 64 + 2 * 32 + 64 + 3 * 128
_HEAD = 10 * 8


def test_every_text_architecture_has_a_checkpoint_in_the_shape_family():
    text = {name for name, info in ARCHITECTURES.items() if not info.multimodal and info.runner == "generate"}
    assert set(zoo_step.ZOO) == text
    assert zoo_step.architectures()[0] == zoo_step.BASELINE
    assert len({arch.key() for arch in zoo_step.ZOO.values()}) == len(zoo_step.ZOO)


@pytest.mark.parametrize("tied", [False, True])
def test_matmul_weights_count_the_layers_and_the_head_once_never_the_lookup(tied):
    config = transformers.LlamaConfig(**_LLAMA, tie_word_embeddings=tied)
    assert zoo_step.matmul_weights(zoo_step.model_on_meta(config)) == 2 * _LLAMA_LAYER + _HEAD


def test_learned_positions_are_looked_up_not_multiplied():
    config = transformers.GPT2Config(n_embd=8, n_layer=2, n_head=2, n_inner=16, n_positions=32, vocab_size=10)
    # c_attn 8 x 24, attention c_proj 8 x 8, c_fc 8 x 16, MLP c_proj 16 x 8; the tied head
    layer = 8 * 24 + 8 * 8 + 8 * 16 + 16 * 8
    assert zoo_step.matmul_weights(zoo_step.model_on_meta(config)) == 2 * layer + _HEAD


def test_a_moe_counts_its_active_experts_and_its_router():
    config = transformers.MixtralConfig(**_LLAMA, num_local_experts=4, num_experts_per_tok=2)
    attention = 64 + 2 * 32 + 64
    experts_active = 2 * 3 * 8 * 16  # 2 of the 4 experts' gate / up / down
    router = 4 * 8
    assert zoo_step.matmul_weights(zoo_step.model_on_meta(config)) == 2 * (attention + experts_active + router) + _HEAD


def test_step_flops_by_hand():
    flops = zoo_step.step_flops(weights=1000, contexts_total=300, batch=3, heads=2, head_dim=4, layers=5)
    assert flops == {"matmul": 2 * 1000 * 3, "attention": 4 * 300 * 2 * 4 * 5, "total": 6000 + 48000}


def test_each_architecture_is_read_against_the_llama_steps_measured_around_it():
    def row(name: str, step_ms: float, gflop: float) -> dict:
        return {"architecture": name, "step_ms": step_ms, "forward_ms": step_ms / 2, "attention_ms": step_ms / 4,
                "lm_head_ms": 1.0, "gflop": gflop, "matmul_weights": 10**6}

    before, after = row(zoo_step.BASELINE, 10.0, 0.5), row(zoo_step.BASELINE, 14.0, 0.5)
    # 24 ms for 1.0 GFLOP against Llama's mean 12 ms for 0.5 GFLOP: the same time per FLOP
    assert zoo_step.per_flop_ratio(row("X", 24.0, 1.0), before, after, "step_ms") == pytest.approx(1.0)
    assert zoo_step.per_flop_ratio(row("X", 24.0, 0.5), before, after, "forward_ms") == pytest.approx(2.0)
    samples = [{**row("X", ms, 0.5), "step_ms_per_flop_vs_llama": ratio, "forward_ms_per_flop_vs_llama": ratio}
               for ms, ratio in ((20.0, 1.6), (30.0, 1.2), (25.0, 1.4))]
    combined = zoo_step.combine(samples)
    assert (combined["step_ms"], combined["step_ms_per_flop_vs_llama"]) == (25.0, 1.4)
    assert combined["step_ms_per_flop_vs_llama_per_round"] == [1.6, 1.2, 1.4]
    baseline = zoo_step.combine([before, after, row(zoo_step.BASELINE, 12.0, 0.5)])
    assert baseline["step_ms"] == 12.0 and baseline["step_ms_per_flop_vs_llama"] == 1.0
    assert "X" in zoo_step.format_table([baseline, combined])


def test_the_step_is_bench_steps_with_this_commands_workload():
    import argparse

    parser = argparse.ArgumentParser()
    zoo_step.add_arguments(parser)
    args = parser.parse_args(["--batch-size", "8", "--steps", "5", "--profile", "3"])
    step = zoo_step._step_args(args, "/some/model")
    assert (step.model, step.batch_size, step.steps, step.profile) == ("/some/model", 8, 5, 3)
    assert (step.input_len_min, step.input_len_max, step.kv_cache_memory_bytes) == (64, 256, 512 << 20)
    assert step.quantization is None and step.kv_cache_dtype == "auto"
