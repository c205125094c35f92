"""A pre-quantized compressed-tensors checkpoint ("pack-quantized", weight-only int8 / int4) made
locally with the ``compressed-tensors`` library loads, is detected from config.json, and holds
exactly the weights gridserve's own quantization at init gives the float checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from gridserve import LLM, SamplingParams
from gridserve.services.worker.parallel_layers import QuantizableLinear

ct = pytest.importorskip(
    "compressed_tensors", reason="the quant extra (compressed-tensors) is not installed"
)

GROUP = 32  # the tiny model's widths (64, 128) are multiples of it


def _build(src, out, bits: int) -> None:
    """Quantize ``src`` with compressed-tensors (scales set to gridserve's amax / qmax) and save packed."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationConfig,
        QuantizationScheme,
        apply_quantization_config,
    )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(src)
    weights = (
        QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="channel")
        if bits == 8
        else QuantizationArgs(
            num_bits=4, type="int", symmetric=True, strategy="group", group_size=GROUP
        )
    )
    config = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=weights)},
        ignore=["lm_head"],
    )
    apply_quantization_config(model, config)
    qmax = 127.0 if bits == 8 else 7.0
    for module in model.modules():
        if hasattr(module, "weight_scale"):
            w = module.weight.data
            grouped = w.reshape(w.shape[0], -1, w.shape[1] if bits == 8 else GROUP)
            module.weight_scale.data = (
                (grouped.abs().amax(-1) / qmax).clamp(min=1e-12).to(module.weight_scale.dtype)
            )
            module.weight_zero_point.data.zero_()
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(str(out))
    AutoTokenizer.from_pretrained(src).save_pretrained(out)


def _layers(llm):
    model = llm.llm_engine.core.executor.worker.runner.model
    return {m.prefix: m for m in model.modules() if isinstance(m, QuantizableLinear)}


@pytest.mark.parametrize("bits", [8, 4])
def test_compressed_tensors_checkpoint_matches_quantization_at_init(llama_tiny, tmp_path, bits):
    folder = tmp_path / f"ct-int{bits}"
    _build(llama_tiny, folder, bits)
    saved = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert saved["quant_method"] == "compressed-tensors" and saved["format"] == "pack-quantized"

    method = "int8" if bits == 8 else "int4"
    prequantized = LLM(str(folder), kv_cache_memory_bytes=1 << 22)
    at_init = LLM(
        str(llama_tiny),
        kv_cache_memory_bytes=1 << 22,
        quantization_config={"method": method, "group_size": GROUP, "ignore": ["lm_head"]},
    )
    try:
        assert prequantized.llm_engine.core.config.model.quantization == "compressed-tensors"
        a, b = _layers(prequantized), _layers(at_init)
        quantized = {p for p, m in a.items() if m.qweight is not None}
        assert quantized == {p for p, m in b.items() if m.qweight is not None}
        assert len(quantized) == 8 and "lm_head" not in quantized
        for prefix in quantized:
            torch.testing.assert_close(
                a[prefix].qweight.dequantize(), b[prefix].qweight.dequantize(), atol=1e-6, rtol=1e-6
            )
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        out = prequantized.generate(["def main(", "class A"], params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 12 for o in out)
    finally:
        prequantized.shutdown()
        at_init.shutdown()
