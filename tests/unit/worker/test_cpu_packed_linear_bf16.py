"""bf16 weights in oneDNN's packed layout (issue 40): packed only where the CPU has native bf16,
and then the same results as the plain bf16 path within bf16's rounding (both accumulate in fp32
and round the output; the summation order differs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gridserve.services.worker import cpu_packed_linear
from gridserve.services.worker.model_runner import ModelRunner
from gridserve.services.worker.parallel_layers import (
    ColumnParallelLinear,
    QuantizableLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from gridserve.services.worker.parallel_state import ParallelState, set_parallel_state
from gridserve.shared.config import GridserveConfig
from gridserve.shared.parallel import Shard

native = pytest.mark.skipif(
    not (cpu_packed_linear.available() and cpu_packed_linear.native_bf16()),
    reason="no oneDNN or no native bf16 on this CPU",
)


def _bf16_close(got: torch.Tensor, want: torch.Tensor, ulps: float = 2.0) -> None:
    """Within a few bf16 ulps (2^-8 relative) of the output's scale."""
    assert got.shape == want.shape and got.dtype == want.dtype
    scale = want.float().abs().max().item()
    assert (got.float() - want.float()).abs().max().item() <= ulps * 2.0**-8 * scale


def _bf16_layers() -> list[QuantizableLinear]:
    state = ParallelState.single()
    layers = [
        ColumnParallelLinear(96, [Shard(0, 64, 64), Shard(0, 32, 32)], bias=True),
        RowParallelLinear(Shard(0, 80, 80), 96, bias=False, state=state),
        VocabParallelEmbedding(1000, 96, state, prefix="lm_head"),
    ]
    gen = torch.Generator().manual_seed(0)
    for layer in layers:
        with torch.no_grad():
            for p in layer.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        layer.to(torch.bfloat16)
    return layers


@native
@pytest.mark.parametrize("rows", [1, 16, 300])
def test_packed_bf16_layers_match_bf16_f_linear_within_bf16_rounding(rows):
    gen = torch.Generator().manual_seed(rows)
    for layer in _bf16_layers():
        x = torch.randn(rows, layer.weight.shape[1], generator=gen).bfloat16()
        bias = getattr(layer, "bias", None)
        want = F.linear(x, layer.weight, bias)
        assert (
            layer.pack_for_cpu() and layer.weight.is_mkldnn and layer.weight.dtype == torch.bfloat16
        )
        got = layer.matmul(x) if isinstance(layer, VocabParallelEmbedding) else layer(x)
        _bf16_close(got, want)


def test_bf16_weights_stay_plain_without_native_bf16(monkeypatch):
    monkeypatch.setattr(cpu_packed_linear, "native_bf16", lambda: False)
    for layer in _bf16_layers():
        assert not layer.pack_for_cpu() and not layer.weight.is_mkldnn
    fp32 = torch.randn(8, 4)
    assert cpu_packed_linear.packable(fp32)  # fp32 does not depend on it


def _runner(model_path, **kwargs) -> ModelRunner:
    set_parallel_state(ParallelState.single())
    config = GridserveConfig.from_kwargs(
        model=str(model_path), device="cpu", dtype="bfloat16", **kwargs
    ).finalize()
    runner = ModelRunner(config, torch.device("cpu"))
    runner.load_model()
    return runner


def _linears(model) -> dict[str, QuantizableLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantizableLinear)}


@native
@pytest.mark.parametrize("fixture", ["llama_tiny", "qwen2_tiny"])  # a separate LM head; a tied one
def test_a_bf16_runner_packs_every_linear_and_the_lm_head(fixture, request, monkeypatch):
    packed = _runner(request.getfixturevalue(fixture))
    monkeypatch.setenv("GRIDSERVE_CPU_PACKED_LINEAR", "0")
    plain = _runner(request.getfixturevalue(fixture))
    layers, plain_layers = _linears(packed.model), _linears(plain.model)
    assert {n for n, m in layers.items() if not m.weight.is_mkldnn} == {"model.embed_tokens"}
    for name, m in layers.items():
        weight = m.weight.to_dense() if m.weight.is_mkldnn else m.weight
        assert weight.dtype == torch.bfloat16 and torch.equal(weight, plain_layers[name].weight)
    head = packed.model.logits_head
    assert (
        head.weight.is_mkldnn or head._packed_head is not None
    )  # the tied table keeps a packed copy
    hidden = torch.randn(7, head.weight.shape[1]).bfloat16()
    with torch.inference_mode():
        _bf16_close(packed.model.compute_logits(hidden), plain.model.compute_logits(hidden))


PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n",
    "class Scheduler:\n    def __init__(self",
    "The quick brown fox",
    "for i in range(10):\n    print(",
    "return self._cache[",
]
CLEAR_GAP = 0.1  # nats between the top two candidates: bf16 rounding cannot swap them


def _greedy(model_path, packed: bool, monkeypatch) -> list:
    from gridserve import LLM, SamplingParams

    monkeypatch.setenv("GRIDSERVE_CPU_PACKED_LINEAR", "1" if packed else "0")
    llm = LLM(model=str(model_path), dtype="bfloat16", device="cpu", max_model_len=256)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2)
        return [r.outputs[0] for r in llm.generate(PROMPTS, params, use_tqdm=False)]
    finally:
        llm.shutdown()


@native
def test_bf16_llm_greedy_tokens_match_the_plain_bf16_path_where_the_top_two_are_clear(
    qwen2_tiny, monkeypatch
):
    plain = _greedy(qwen2_tiny, False, monkeypatch)
    packed = _greedy(qwen2_tiny, True, monkeypatch)
    compared = 0
    for want, got in zip(plain, packed):
        for step, (token, top) in enumerate(zip(want.token_ids, want.logprobs)):
            ranked = sorted((lp.logprob for lp in top.values()), reverse=True)
            if got.token_ids[step] != token:
                assert ranked[0] - ranked[1] < CLEAR_GAP, (
                    f"step {step}: {got.token_ids[step]} != {token}"
                )
                break  # a near tie went the other way: the rest of the row follows another prefix
            assert abs(got.logprobs[step][token].logprob - top[token].logprob) < 0.05
            compared += 1
    assert compared >= len(PROMPTS) * 8
