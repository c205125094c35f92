"""GGUF tensors in the worker: every supported type dequantized bit-exactly like the ``gguf``
package's own reference, llama.cpp's Q/K permutation undone, HF names, and clear errors at start."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from gridserve.services.worker.gguf_loader import (
    dequantize,
    hf_name,
    iterate_gguf_weights,
    unpermute_qk,
)
from gridserve.shared.config import ModelConfig
from gridserve.shared.errors import ConfigError
from gridserve.shared.gguf_config import SUPPORTED_TENSOR_TYPES
from tests.gguf_files import permute_qk, write_gguf

Q = gguf.GGMLQuantizationType
ROWS, COLS = 6, 512  # two super-blocks of 256 per row


def _random_k_blocks(qtype: Q, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random raw K-quant blocks (gguf cannot quantize these) whose fp16 scales are finite."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    scales = rng.uniform(-0.05, 0.05, size=(n_blocks, 2)).astype(np.float16).view(np.uint8)
    if qtype == Q.Q6_K:  # d is the block's last two bytes
        raw[:, -2:] = scales[:, :2]
    else:  # d, dmin first
        raw[:, :4] = scales
    return raw


def _raw_tensors(rng: np.random.Generator) -> dict[str, tuple[np.ndarray, Q]]:
    values = rng.standard_normal((ROWS, COLS)).astype(np.float32)
    out: dict[str, tuple[np.ndarray, Q]] = {
        "F32": (values, Q.F32),
        "F16": (values.astype(np.float16), Q.F16),
        "BF16": (gguf.quants.quantize(values, Q.BF16), Q.BF16),
    }
    for name in ("Q8_0", "Q4_0", "Q4_1"):
        out[name] = (gguf.quants.quantize(values, Q[name]), Q[name])
    for name in ("Q4_K", "Q5_K", "Q6_K"):
        qtype = Q[name]
        blocks = _random_k_blocks(qtype, ROWS * COLS // 256, rng)
        out[name] = (blocks.reshape(ROWS, -1), qtype)
    return out


def test_every_supported_type_is_covered():
    assert set(_raw_tensors(np.random.default_rng(0))) == set(SUPPORTED_TENSOR_TYPES)


@pytest.mark.parametrize("type_name", SUPPORTED_TENSOR_TYPES)
def test_dequantize_is_bit_exact_against_gguf(tmp_path, type_name):
    """Written with the gguf writer, read back with its reader: our torch dequantization equals
    ``gguf.quants.dequantize`` bit for bit (NaN-free inputs)."""
    data, qtype = _raw_tensors(np.random.default_rng(1))[type_name]
    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("x", data, raw_dtype=qtype if qtype not in (Q.F32, Q.F16) else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (tensor,) = gguf.GGUFReader(str(path)).tensors
    assert tensor.tensor_type == qtype
    ours = dequantize(tensor.data, type_name, (ROWS, COLS))
    reference = torch.from_numpy(np.array(gguf.quants.dequantize(tensor.data, qtype), np.float32))
    assert ours.dtype == torch.float32 and ours.shape == (ROWS, COLS)
    assert torch.isfinite(ours).all()
    assert torch.equal(ours.view(torch.int32), reference.reshape(ROWS, COLS).view(torch.int32))


def test_unpermute_undoes_llama_cpp_permutation():
    w = np.random.default_rng(2).standard_normal((2 * 16, 8)).astype(np.float32)
    for heads in (1, 2):
        back = unpermute_qk(torch.from_numpy(permute_qk(w, heads).copy()), heads)
        assert torch.equal(back, torch.from_numpy(w))


def test_hf_names():
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("blk.1.attn_q.bias") == "model.layers.1.self_attn.q_proj.bias"
    assert hf_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert hf_name("blk.0.unknown.weight") is None
    assert hf_name("blk.2.ffn_gate_inp.weight") == "model.layers.2.block_sparse_moe.gate.weight"
    assert hf_name("blk.2.ffn_down.3.weight") == "model.layers.2.block_sparse_moe.experts.3.w2.weight"


@pytest.mark.parametrize("fixture", ["llama_tiny", "qwen2_tiny", "mixtral_tiny"])
def test_gguf_tensors_equal_the_safetensors(request, tmp_path, fixture):
    """A float32 GGUF of a recipe checkpoint yields the very tensors of its safetensors (Q/K rows
    permuted back for llama and Mixtral, untouched for qwen2; Mixtral's stacked experts one by
    one), under the same names."""
    from safetensors.torch import load_file

    folder = request.getfixturevalue(fixture)
    path = write_gguf(folder, tmp_path / "m.gguf")
    config = ModelConfig(model=str(path)).resolve()
    expected = load_file(str(folder / "model.safetensors"))
    got = {name: t.full() for name, t in iterate_gguf_weights(path, config.hf_config)}
    assert set(got) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def test_config_from_gguf_matches_config_json(llama_tiny, qwen2_tiny, mixtral_tiny, tmp_path):
    for folder in (llama_tiny, qwen2_tiny, mixtral_tiny):
        gguf_cfg = ModelConfig(model=str(write_gguf(folder, tmp_path / f"{folder.name}.gguf"))).resolve()
        hf_cfg = ModelConfig(model=str(folder)).resolve()
        for key in ("architecture", "num_layers", "num_kv_heads", "head_dim", "vocab_size",
                    "max_model_len", "resolved_dtype", "eos_token_id"):
            assert getattr(gguf_cfg, key) == getattr(hf_cfg, key), (folder.name, key)
        for key in ("hidden_size", "intermediate_size", "num_attention_heads", "rms_norm_eps",
                    "tie_word_embeddings", "rope_parameters", "bos_token_id", "pad_token_id",
                    "num_local_experts", "num_experts_per_tok"):
            assert gguf_cfg.hf_config.get(key) == hf_cfg.hf_config.get(key), (folder.name, key)


# --- clear errors at start -------------------------------------------------------------------


def _expect_config_error(path, *words):
    with pytest.raises(ConfigError) as info:
        ModelConfig(model=str(path)).resolve()
    assert info.value.field == "model.model"
    for word in (str(path), *words):
        assert word in str(info.value), (word, str(info.value))


def test_unsupported_architecture(llama_tiny, tmp_path):
    path = write_gguf(llama_tiny, tmp_path / "mamba.gguf", arch="mamba")
    _expect_config_error(path, "general.architecture", "'mamba'", "'gemma2'", "'falcon'")


def test_truncated_file(llama_tiny, tmp_path):
    path = write_gguf(llama_tiny, tmp_path / "full.gguf")
    data = path.read_bytes()
    for keep in (len(data) - 1000, 200):  # inside the tensor data; inside the header
        cut = tmp_path / f"cut{keep}.gguf"
        cut.write_bytes(data[:keep])
        _expect_config_error(cut, "truncated")


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"not a gguf file at all" * 10)
    _expect_config_error(path, "not a readable GGUF")


def test_unsupported_tensor_type(llama_tiny, tmp_path):
    path = write_gguf(llama_tiny, tmp_path / "q5.gguf", tensor_type="Q5_0")
    _expect_config_error(path, "Q5_0", "output.weight")


def test_missing_gguf_file(tmp_path):
    from gridserve.shared.errors import ModelNotFoundError

    with pytest.raises(ModelNotFoundError, match="nothere.gguf"):
        ModelConfig(model=str(tmp_path / "nothere.gguf")).resolve()
