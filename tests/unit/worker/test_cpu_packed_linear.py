"""The CPU's packed fp32 linears: same results as ``F.linear`` (1e-5 relative), used only where they apply."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gridserve.services.worker import cpu_packed_linear
from gridserve.services.worker.checkpoint import CheckpointTensor, LoadReport
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

pytestmark = pytest.mark.skipif(not cpu_packed_linear.available(), reason="torch without oneDNN")


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


def _filled(layer: QuantizableLinear, seed: int) -> QuantizableLinear:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return layer


def _layers() -> list[QuantizableLinear]:
    state = ParallelState.single()
    return [
        _filled(ColumnParallelLinear(96, [Shard(0, 64, 64), Shard(0, 32, 32)], bias=True), 0),
        _filled(ColumnParallelLinear(96, [Shard(0, 80, 80)], bias=False), 1),
        _filled(RowParallelLinear(Shard(0, 80, 80), 96, bias=False, state=state), 2),
        _filled(VocabParallelEmbedding(1000, 96, state, prefix="lm_head"), 3),
    ]


@pytest.mark.parametrize("rows", [1, 3, 64, 300])
def test_packed_layers_match_f_linear_within_1e_5_at_any_batch(rows):
    gen = torch.Generator().manual_seed(rows)
    for layer in _layers():
        x = torch.randn(rows, layer.weight.shape[1], generator=gen)
        bias = getattr(layer, "bias", None)
        want = F.linear(x, layer.weight, bias)
        shape = tuple(layer.weight.shape)
        assert layer.pack_for_cpu() and layer.weight.is_mkldnn and tuple(layer.weight.shape) == shape
        if isinstance(layer, VocabParallelEmbedding):
            _close(layer.matmul(x), want)
        else:
            _close(layer(x), want)
            _close(layer(x.view(1, rows, -1)), want.view(1, rows, -1))  # leading dims kept


def test_quantized_batch_invariant_and_looked_up_weights_stay_plain():
    quantized, invariant, plain = _layers()[:3]
    quantized.quantize("int8")
    invariant.batch_invariant = True
    embedding = _filled(VocabParallelEmbedding(1000, 96, ParallelState.single(), prefix="model.embed_tokens"), 4)
    for layer in (quantized, invariant, embedding):
        assert not layer.pack_for_cpu() and not layer.cpu_packed
    assert quantized.weight is None and not invariant.weight.is_mkldnn and not embedding.weight.is_mkldnn
    assert plain.pack_for_cpu() and not plain.pack_for_cpu()  # packing twice is a no-op


def test_loading_into_a_packed_layer_restores_plain_weights_and_repack_packs_the_new_values():
    layer = _layers()[0]
    layer.pack_for_cpu()
    new = torch.randn(32, 96)
    layer.load("weight", CheckpointTensor("w", (32, 96), new.__getitem__, LoadReport()), shard_id=1)
    assert not layer.weight.is_mkldnn and torch.equal(layer.weight[64:], new)  # the rest survives
    kept = layer.weight.detach().clone()
    assert cpu_packed_linear.repack(layer) == 1 and layer.weight.is_mkldnn
    assert torch.equal(layer.weight.to_dense(), kept)
    x = torch.randn(5, 96)
    _close(layer(x), F.linear(x, kept, layer.bias))


def _runner(model_path, **kwargs) -> ModelRunner:
    set_parallel_state(ParallelState.single())
    config = GridserveConfig.from_kwargs(model=str(model_path), device="cpu", **kwargs).finalize()
    runner = ModelRunner(config, torch.device("cpu"))
    runner.load_model()
    return runner


def _linears(model) -> dict[str, QuantizableLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, QuantizableLinear)}


def test_the_runner_packs_every_decoder_linear_and_the_lm_head_not_the_embedding(llama_tiny, monkeypatch):
    packed = _runner(llama_tiny)
    monkeypatch.setenv("GRIDSERVE_CPU_PACKED_LINEAR", "0")
    plain = _runner(llama_tiny)
    layers = _linears(packed.model)
    assert {n for n, m in layers.items() if not m.weight.is_mkldnn} == {"model.embed_tokens"}
    assert not any(m.weight.is_mkldnn for m in _linears(plain.model).values())
    # same names, shapes and bytes: the packed weight replaced the plain one
    assert [(n, p.shape) for n, p in packed.model.named_parameters()] == \
        [(n, p.shape) for n, p in plain.model.named_parameters()]
    for name, m in layers.items():
        if m.cpu_packed:
            assert torch.equal(m.weight.to_dense(), _linears(plain.model)[name].weight)
    hidden = torch.randn(7, packed.model.logits_head.weight.shape[1])
    with torch.inference_mode():
        _close(packed.model.compute_logits(hidden), plain.model.compute_logits(hidden))


def test_no_packing_in_batch_invariant_mode_quantized_or_off_the_cpu(llama_tiny):
    invariant = _runner(llama_tiny, batch_invariant=True)
    assert not any(m.weight is not None and m.weight.is_mkldnn for m in _linears(invariant.model).values())
    quantized = _runner(llama_tiny, quantization="int8")
    assert not any(m.qweight is not None and m.cpu_packed for m in _linears(quantized.model).values())
    model = _runner(llama_tiny, batch_invariant=True).model
    assert cpu_packed_linear.pack_model(model, torch.device("cuda", 0)) == 0


def test_release_lets_a_packed_model_go_to_the_meta_device(llama_tiny):
    model = _runner(llama_tiny).model
    released = cpu_packed_linear.release(model)
    assert released == sum(1 for m in _linears(model).values() if m.cpu_packed) > 0
    model.to_empty(device="meta")
    assert all(p.is_meta for p in model.parameters())


def test_a_tied_head_reads_a_packed_copy_and_the_lookup_the_plain_table():
    """Tied embeddings (SmolLM2, Gemma, ...): the logits GEMM was a plain F.linear (~3x slower)."""
    state = ParallelState.single()
    tied = _filled(VocabParallelEmbedding(1000, 96, state, prefix="model.embed_tokens"), 5)
    x = torch.randn(64, 96, generator=torch.Generator().manual_seed(6))
    want = F.linear(x, tied.weight)
    ids = torch.tensor([3, 999, 0])
    lookup = tied(ids)
    assert tied.pack_head_copy() and not tied.pack_head_copy()  # once
    assert not tied.weight.is_mkldnn and tied._packed_head.is_mkldnn
    _close(tied.matmul(x), want)
    assert torch.equal(tied(ids), lookup)
    new = torch.randn(1000, 96, generator=torch.Generator().manual_seed(7))
    tied.load("weight", CheckpointTensor("w", tuple(new.shape), lambda index: new[index], LoadReport()))
    assert tied._packed_head is None  # a load makes the copy stale: dropped, then packed again
    _close(tied.matmul(x), F.linear(x, new))
    assert tied.pack_head_copy() and tied.release_packed_copy() and tied._packed_head is None
