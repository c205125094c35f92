"""GGUF checkpoints in the worker: tensors dequantized at load under Hugging Face names.

``iterate_gguf_weights`` yields the file's tensors as ``CheckpointTensor``s named and laid out
like the architecture's safetensors checkpoint (``blk.3.attn_q.weight`` ->
``model.layers.3.self_attn.q_proj.weight``; ``gguf_tensors`` names them per architecture and undoes
llama.cpp's converter steps: Q/K row permutation, Gemma's ``1 + w`` norms, GPT-2's transposes,
Bloom / GPT-NeoX / Falcon fused Q/K/V orders, stacked experts and StableLM's stacked Q/K norms), so
every model's ``load_weights``, tensor-parallel slicing and ``--quantization`` work unchanged.
Each tensor is dequantized to float32 when first read (the float operations of the ``gguf``
package's numpy reference, in its order: bit-exact) and then copied into the serving dtype by the
model. Quantized GGUF blocks (Q4_1's offsets, K-quants' two-level scales) do not map losslessly
onto gridserve's per-channel int8 / symmetric int4 layers, hence dequantization; ``--quantization``
re-quantizes as for any checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from gridserve.services.worker.checkpoint import CheckpointTensor, LoadReport
from gridserve.services.worker.gguf_tensors import LAYOUTS, Transform, unpermute_qk  # noqa: F401 (re-exported)
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


def hf_name(gguf_name: str, arch: str = "llama") -> Optional[str]:
    """The Hugging Face name of GGUF tensor ``gguf_name`` in architecture ``arch`` when it maps to one
    whole tensor; None when it has no such place (``gguf_tensors.LAYOUTS``)."""
    return LAYOUTS[arch].hf_name(gguf_name)


def iterate_gguf_weights(path: str | Path, hf_config: dict,
                         report: Optional[LoadReport] = None) -> Iterator[tuple[str, CheckpointTensor]]:
    """Yield ``(hf_name, CheckpointTensor)`` for every tensor of the GGUF file at ``path``, laid out
    as the architecture's safetensors checkpoint (``gguf_tensors``: llama.cpp's steps undone).

    A tensor's bytes are memory-mapped and dequantized (float32) on its first read, and dropped
    with its ``CheckpointTensor``s (a tensor split into several, one per expert or per head, is read
    once for all of them).
    """
    report = report if report is not None else LoadReport()
    gguf_file = read_gguf(path)
    arch = gguf_architecture(gguf_file)
    check_tensor_types(gguf_file)
    layout = LAYOUTS[arch]
    for tensor in gguf_file.tensors:
        placement = layout.place(tensor.name, tensor.shape, hf_config)
        if placement is None:
            raise ConfigError("model.model", f"{str(path)!r}: tensor {tensor.name!r} has no place in "
                                             f"{hf_config['architectures'][0]}")
        if not placement.names:
            continue
        read = _lazy_reader(gguf_file.path, tensor, placement.transform)
        shape = _shape_after(tensor.shape, placement.transform)
        if not placement.rows:
            yield placement.names[0], CheckpointTensor(placement.names[0], shape, read, report)
            continue
        if sum(placement.rows) != shape[0]:
            raise ConfigError("model.model", f"{str(path)!r}: tensor {tensor.name!r} has {shape[0]} rows, "
                                             f"{sum(placement.rows)} expected for {hf_config['architectures'][0]}")
        start = 0
        for name, rows in zip(placement.names, placement.rows):
            yield name, CheckpointTensor(name, (rows, *shape[1:]), _rows_reader(read, start, start + rows), report)
            start += rows


def _shape_after(shape: tuple[int, ...], transform: Optional[Transform]) -> tuple[int, ...]:
    """The shape ``transform`` gives a tensor of ``shape`` (traced on the meta device: nothing read)."""
    if transform is None:
        return shape
    return tuple(transform(torch.empty(shape, device="meta")).shape)


def _lazy_reader(path: str, tensor: GgufTensorInfo, transform: Optional[Transform]):
    full: list[torch.Tensor] = []

    def read(index: tuple) -> torch.Tensor:
        if not full:
            raw = np.memmap(path, dtype=np.uint8, mode="r", offset=tensor.offset, shape=(tensor.n_bytes,))
            values = dequantize(raw, tensor.type_name, tensor.shape)
            del raw
            full.append(values if transform is None else transform(values))
        return full[0][index]

    return read


def _rows_reader(read, start: int, end: int):
    """Rows ``start:end`` of ``read``'s tensor, indexed as a tensor of their own."""

    def rows(index: tuple) -> torch.Tensor:
        first, last, _ = index[0].indices(end - start)
        return read((slice(start + first, start + last), *index[1:]))

    return rows


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
