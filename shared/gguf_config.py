"""A GGUF file's metadata as a Hugging Face ``config.json``-like dict (no torch).

``gridserve serve model.gguf`` / ``LLM(model="model.gguf")``: the engine and the gateway read the
file's key/value header with the ``gguf`` package (a memory map: nothing but the header is read),
and the worker gets the resulting dict as ``hf_config_json`` like any checkpoint's config.json.
Every check that can fail happens here, at start: a file that is not GGUF or is cut short, an
architecture gridserve does not build, a tensor type the loader cannot dequantize — each a
``ConfigError`` naming the file and the field.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from gridserve.shared.errors import ConfigError

# GGUF ``general.architecture`` -> the gridserve architecture built for it. llama.cpp writes
# Mistral checkpoints as "llama", and Mixtral ones as "llama" with ``llama.expert_count``.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# Tensor types the worker dequantizes (``services/worker/gguf_loader.py``), by ggml type name.
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")
# GGUF files carry no serving dtype; quantized blocks dequantize exactly to float32 (fp16 scales
# times small integers), so "auto" serves in float32.
SERVING_DTYPE = "float32"


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` names a GGUF file (by its ``.gguf`` suffix)."""
    return str(path).lower().endswith(".gguf")


@dataclass(frozen=True)
class GgufTensorInfo:
    """One tensor of a GGUF file: ggml type name, shape in torch order, where its bytes are."""

    name: str
    type_name: str
    shape: tuple[int, ...]
    offset: int  # from the start of the file
    n_bytes: int


@dataclass
class GgufFile:
    """A GGUF file's header as plain Python values: every metadata field and the tensor table."""

    path: str
    fields: dict[str, Any] = field(default_factory=dict)
    tensors: list[GgufTensorInfo] = field(default_factory=list)

    def get(self, key: str, default: Any = None) -> Any:
        """The value of metadata ``key`` (a scalar, a string or a list), ``default`` when absent."""
        return self.fields.get(key, default)


def read_gguf(path: str | Path) -> GgufFile:
    """The header of the GGUF file at ``path``; a missing, foreign, big-endian or truncated file is a
    ConfigError naming it.

    Parsing (the ``gguf`` package's reader: one numpy array per vocabulary string) takes seconds
    for a 49k-token vocabulary, so the plain-Python result is kept per process, shared by the
    config, the tokenizer and the loader, until the file changes; the reader itself is dropped.
    """
    file = Path(path)
    if not file.is_file():
        raise ConfigError("model.model", f"GGUF file {str(file)!r} does not exist")
    stat = file.stat()
    return _read_gguf(str(file.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _read_gguf(path: str, size: int, mtime_ns: int) -> GgufFile:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as exc:  # noqa: BLE001 - the reader raises ValueError / IndexError / ... on bad bytes
        raise ConfigError("model.model", f"{path!r} is not a readable GGUF file (truncated, corrupt, or "
                                         f"a tensor type unknown to gguf?): {type(exc).__name__}: {exc}") from None
    if reader.byte_order != "I" or sys.byteorder != "little":
        raise ConfigError("model.model", f"{path!r}: only little-endian GGUF files are supported")
    result = GgufFile(path)
    for key, value in reader.fields.items():
        if not key.startswith("GGUF."):
            result.fields[key] = value.contents()
    for tensor in reader.tensors:
        if int(tensor.data_offset) + int(tensor.n_bytes) > size:
            raise ConfigError("model.model", f"{path!r} is truncated: tensor {tensor.name!r} "
                                             f"ends past the end of the file ({size} bytes)")
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        result.tensors.append(GgufTensorInfo(tensor.name, tensor.tensor_type.name, shape,
                                             int(tensor.data_offset), int(tensor.n_bytes)))
    return result


def gguf_architecture(gguf_file: GgufFile) -> str:
    arch = gguf_file.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ConfigError("model.model", f"{gguf_file.path!r}: general.architecture {arch!r} is not "
                                         f"supported for GGUF files; supported: {sorted(ARCHITECTURES)}")
    return arch


def check_tensor_types(gguf_file: GgufFile) -> None:
    """Every tensor's type must be one the loader dequantizes."""
    for tensor in gguf_file.tensors:
        if tensor.type_name not in SUPPORTED_TENSOR_TYPES:
            raise ConfigError("model.model", f"{gguf_file.path!r}: tensor {tensor.name!r} has GGUF type "
                                             f"{tensor.type_name}, which gridserve cannot load; "
                                             f"supported: {', '.join(SUPPORTED_TENSOR_TYPES)}")


def hf_config_from_gguf(path: str | Path) -> dict[str, Any]:
    """The config.json-like dict of the GGUF file at ``path`` (``architectures``, sizes, rope, norms,
    context, token ids), checked: architecture and tensor types supported, sizes present."""
    gguf_file = read_gguf(path)
    arch = gguf_architecture(gguf_file)
    check_tensor_types(gguf_file)

    def get(key: str, default: Any = None, required: bool = False) -> Any:
        value = gguf_file.get(f"{arch}.{key}", default)
        if required and value is None:
            raise ConfigError("model.model", f"{str(path)!r}: metadata {arch}.{key} is missing")
        if isinstance(value, list):  # per-layer values (head_count_kv): gridserve needs them uniform
            if not value or len(set(value)) != 1:
                raise ConfigError("model.model", f"{str(path)!r}: metadata {arch}.{key} differs per "
                                                 "layer, which gridserve does not support")
            value = value[0]
        return value

    experts = int(get("expert_count", 0) or 0)
    if experts and arch != "llama":
        raise ConfigError("model.model", f"{str(path)!r}: {arch}.expert_count: mixture-of-experts "
                                         f"{arch} GGUF files are not supported (llama's, Mixtral, are)")
    names = {t.name for t in gguf_file.tensors}
    if "rope_freqs.weight" in names:
        raise ConfigError("model.model", f"{str(path)!r}: tensor 'rope_freqs.weight' (llama3-style "
                                         "RoPE frequencies) is not supported for GGUF files yet")
    hidden = int(get("embedding_length", required=True))
    heads = int(get("attention.head_count", required=True))
    kv_heads = int(get("attention.head_count_kv", heads))
    head_dim = int(get("attention.key_length", 0) or hidden // heads)
    rotary = get("rope.dimension_count")
    if rotary is not None and int(rotary) != head_dim:
        raise ConfigError("model.model", f"{str(path)!r}: {arch}.rope.dimension_count={rotary}: partial "
                                         f"rotary embeddings (head size {head_dim}) are not supported")
    vocab = int(get("vocab_size", 0))
    if not vocab:  # older files: the vocabulary's length
        vocab = len(gguf_file.get("tokenizer.ggml.tokens") or [])
    embed = next((t for t in gguf_file.tensors if t.name == "token_embd.weight"), None)
    if embed is None:
        raise ConfigError("model.model", f"{str(path)!r}: tensor 'token_embd.weight' is missing")
    if not vocab:
        vocab = int(embed.shape[0])
    rope: dict[str, Any] = {"rope_theta": _f32(get("rope.freq_base", 10000.0)), "rope_type": "default"}
    scaling = get("rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise ConfigError("model.model", f"{str(path)!r}: {arch}.rope.scaling.type {scaling!r} is not "
                                             "supported (only linear)")
        rope.update(rope_type="linear", factor=_f32(get("rope.scaling.factor", 1.0)))
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length", required=True)),
        "num_hidden_layers": int(get("block_count", required=True)),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_parameters": rope,
        "max_position_embeddings": int(get("context_length", 2048)),
        "vocab_size": vocab,
        # No separate output matrix: the LM head is the embedding (llama.cpp does the same).
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": False,
        "dtype": SERVING_DTYPE,
        "gguf": {"architecture": arch},
    }
    for key, hf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                        ("padding_token_id", "pad_token_id")):
        value: Optional[int] = gguf_file.get(f"tokenizer.ggml.{key}")
        if value is not None:
            config[hf_key] = int(value)
    if arch in ("qwen2", "qwen3"):
        config["use_sliding_window"] = False
        config["sliding_window"] = None
    if experts:  # llama with experts: Mixtral
        used = int(get("expert_used_count", 0) or 0)
        if not 1 <= used <= experts:
            raise ConfigError("model.model", f"{str(path)!r}: {arch}.expert_used_count={used} must be in "
                                             f"[1, {arch}.expert_count={experts}]")
        config.update(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=experts,
                      num_experts_per_tok=used, sliding_window=None)
    return config


def _f32(value: Any) -> float:
    """A float32 metadata value as the shortest decimal that is the same float32 (1e-06, not
    9.99999997e-07), as config.json spells it."""
    import numpy as np

    return float(str(np.float32(value)))
