"""GGUF checkpoints in the worker: tensors dequantized at load under Hugging Face names.

``iterate_gguf_weights`` yields the file's tensors as ``CheckpointTensor``s named like a
safetensors checkpoint's (``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``),
so every model's ``load_weights``, tensor-parallel slicing and ``--quantization`` work unchanged
(Mixtral's stacked ``ffn_*_exps`` become one tensor per expert).
Each tensor is dequantized to float32 when first read (the float operations of the ``gguf``
package's numpy reference, in its order: bit-exact) and then copied into the serving dtype by the
model. Quantized GGUF blocks (Q4_1's offsets, K-quants' two-level scales) do not map losslessly
onto gridserve's per-channel int8 / symmetric int4 layers, hence dequantization; ``--quantization``
re-quantizes as for any checkpoint. For the Llama family, llama.cpp's Q/K row permutation (its
RoPE pairs adjacent rows) is reversed back to the Hugging Face (neox) layout.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from gridserve.services.worker.checkpoint import CheckpointTensor, LoadReport
from gridserve.shared.errors import ConfigError
from gridserve.shared.gguf_config import (
    GgufTensorInfo,
    check_tensor_types,
    gguf_architecture,
    is_gguf,
    read_gguf,
)

QK_K = 256
_LOW_HIGH = np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)  # shifts: low nibble, then high
# GGUF tensor names (per block and global) -> Hugging Face names of the Llama-family models.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",  # qwen3: per-head RMSNorm of queries and keys
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# Mixtral: the router, and every expert's w1 / w3 / w2 stacked ([experts, rows, cols]) or one by one.
_MOE_NAMES = {"ffn_gate_inp": "block_sparse_moe.gate"}
_EXPERT_PROJ = {"ffn_gate": "w1", "ffn_up": "w3", "ffn_down": "w2"}
_STACKED = re.compile(r"^blk\.(\d+)\.(ffn_gate|ffn_up|ffn_down)_exps\.weight$")
_PER_EXPERT = re.compile(r"^blk\.(\d+)\.(ffn_gate|ffn_up|ffn_down)\.(\d+)\.weight$")
# Architectures whose llama.cpp conversion permutes the Q and K rows (``LlamaModel.permute``).
_PERMUTED_QK = {"llama"}


def hf_name(gguf_name: str) -> Optional[str]:
    """The Hugging Face name of GGUF tensor ``gguf_name``; None when gridserve has no place for it."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK.match(gguf_name)
    expert = _PER_EXPERT.match(gguf_name)
    if expert is not None:
        layer, proj, index = expert.groups()
        return f"model.layers.{layer}.block_sparse_moe.experts.{index}.{_EXPERT_PROJ[proj]}.weight"
    if match is None:
        return None
    layer, part, kind = match.groups()
    if part in _MOE_NAMES:
        return f"model.layers.{layer}.{_MOE_NAMES[part]}.{kind}"
    if part not in _BLOCK_NAMES:
        return None
    return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"


def iterate_gguf_weights(path: str | Path, hf_config: dict,
                         report: Optional[LoadReport] = None) -> Iterator[tuple[str, CheckpointTensor]]:
    """Yield ``(hf_name, CheckpointTensor)`` for every tensor of the GGUF file at ``path``.

    A tensor's bytes are memory-mapped and dequantized (float32) on its first read, and dropped
    with its ``CheckpointTensor``.
    """
    report = report if report is not None else LoadReport()
    gguf_file = read_gguf(path)
    arch = gguf_architecture(gguf_file)
    check_tensor_types(gguf_file)
    heads = int(hf_config["num_attention_heads"])
    kv_heads = int(hf_config.get("num_key_value_heads") or heads)
    for tensor in gguf_file.tensors:
        stacked = _STACKED.match(tensor.name)
        if stacked is not None:  # one CheckpointTensor per expert, over one dequantized stack
            layer, proj = stacked.groups()
            read = _lazy_reader(gguf_file.path, tensor, None)
            for expert in range(tensor.shape[0]):
                name = f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{_EXPERT_PROJ[proj]}.weight"
                yield name, CheckpointTensor(name, tensor.shape[1:], _expert_reader(read, expert), report)
            continue
        name = hf_name(tensor.name)
        if name is None:
            raise ConfigError("model.model", f"{str(path)!r}: tensor {tensor.name!r} has no place in "
                                             f"{hf_config['architectures'][0]}")
        permute_heads = None
        if arch in _PERMUTED_QK and ".self_attn.q_proj." in name:
            permute_heads = heads
        elif arch in _PERMUTED_QK and ".self_attn.k_proj." in name:
            permute_heads = kv_heads
        yield name, CheckpointTensor(name, tensor.shape, _lazy_reader(gguf_file.path, tensor, permute_heads),
                                     report)


def _lazy_reader(path: str, tensor: GgufTensorInfo, permute_heads: Optional[int]):
    full: list[torch.Tensor] = []

    def read(index: tuple) -> torch.Tensor:
        if not full:
            raw = np.memmap(path, dtype=np.uint8, mode="r", offset=tensor.offset, shape=(tensor.n_bytes,))
            values = dequantize(raw, tensor.type_name, tensor.shape)
            del raw
            if permute_heads is not None:
                values = unpermute_qk(values, permute_heads)
            full.append(values)
        return full[0][index]

    return read


def _expert_reader(read, expert: int):
    return lambda index: read((expert, *index))


def unpermute_qk(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's ``permute``: its rows (per head: pairs interleaved) back to HF's halves."""
    shape = weight.shape
    return (weight.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).transpose(1, 2)
            .reshape(shape).contiguous())


def dequantize(data: np.ndarray, type_name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A GGUF tensor's bytes (any array over them: the reader's, a memory map) as a float32 tensor of
    ``shape`` (torch order)."""
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if type_name == "F32":
        values = raw.view(np.float32).copy()
    elif type_name == "F16":
        values = raw.view(np.float16).astype(np.float32)
    elif type_name == "BF16":
        values = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    else:
        block_bytes, fn = _BLOCK_TYPES[type_name]
        values = fn(raw.reshape(-1, block_bytes))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).reshape(shape)


# numpy, not torch: these byte-level ops run several times faster on the CPU. Each float operation
# is the one the gguf package's reference does, in its order (float32 products and sums: bit-exact).


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The fp16 at byte ``start`` of every block, as float32 (n, 1)."""
    return np.ascontiguousarray(blocks[:, start:start + 2]).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, groups: int, width: int) -> np.ndarray:
    """(n, groups * width) packed bytes -> (n, groups, 2, width) low then high nibbles."""
    return (qs.reshape(qs.shape[0], groups, 1, width) >> _LOW_HIGH) & np.uint8(0x0F)


def _q8_0(blocks: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(blocks[:, 2:]).view(np.int8).astype(np.float32) * _f16(blocks, 0)


def _q4_0(blocks: np.ndarray) -> np.ndarray:
    q = _nibbles(blocks[:, 2:], 1, 16).reshape(blocks.shape[0], 32).astype(np.int8) - np.int8(8)
    return _f16(blocks, 0) * q.astype(np.float32)


def _q4_1(blocks: np.ndarray) -> np.ndarray:
    q = _nibbles(blocks[:, 4:], 1, 16).reshape(blocks.shape[0], 32).astype(np.float32)
    return (_f16(blocks, 0) * q) + _f16(blocks, 2)


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: twelve bytes -> eight 6-bit scales and eight 6-bit mins per block."""
    d, m, m_d = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=1)
    return sc, mn


def _k_scale_products(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    n = blocks.shape[0]
    sc, mn = _k_scales(blocks[:, 4:16])
    d = (_f16(blocks, 0) * sc.astype(np.float32)).reshape(n, 8, 1)
    dm = (_f16(blocks, 2) * mn.astype(np.float32)).reshape(n, 8, 1)
    return d, dm


def _q4_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    d, dm = _k_scale_products(blocks)
    q = _nibbles(blocks[:, 16:], 4, 32).reshape(n, 8, 32).astype(np.float32)
    return (d * q - dm).reshape(n, QK_K)


def _q5_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    d, dm = _k_scale_products(blocks)
    qh = blocks[:, 16:48].reshape(n, 1, 32)
    high = (qh >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 0x01  # bit j -> sub-block j
    low = _nibbles(blocks[:, 48:], 4, 32).reshape(n, 8, 32)
    q = (low | (high << 4)).astype(np.float32)
    return (d * q - dm).reshape(n, QK_K)


def _q6_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    scales = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)
    d = (_f16(blocks, 208) * scales).reshape(n, QK_K // 16, 1)
    low = _nibbles(blocks[:, :128], 2, 64).reshape(n, 8, 32)
    qh = blocks[:, 128:192].reshape(n, 2, 1, 32)
    high = ((qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 0x03).reshape(n, 8, 32)
    q = (low | (high << 4)).astype(np.int8) - np.int8(32)
    return (d * q.reshape(n, QK_K // 16, 16).astype(np.float32)).reshape(n, QK_K)


# ggml type -> (bytes per block, dequantizer of (n_blocks, bytes) uint8 -> (n_blocks, values)).
_BLOCK_TYPES = {
    "Q8_0": (34, _q8_0),
    "Q4_0": (18, _q4_0),
    "Q4_1": (20, _q4_1),
    "Q4_K": (144, _q4_k),
    "Q5_K": (176, _q5_k),
    "Q6_K": (210, _q6_k),
}


def load_hf_tokenizer(path: str) -> Any:
    """A transformers tokenizer for a tokenizer folder / hub id, or a GGUF file's converted one."""
    if is_gguf(path):
        from transformers import PreTrainedTokenizerFast

        from gridserve.shared.gguf_tokenizer import tokenizer_from_gguf

        converted = tokenizer_from_gguf(str(path))
        return PreTrainedTokenizerFast(tokenizer_object=converted.tokenizer, chat_template=converted.chat_template,
                                       clean_up_tokenization_spaces=False, **converted.special_tokens())
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
