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
from gridserve.shared.gguf_architectures import ARCHITECTURES as GGUF_ARCHITECTURES
from gridserve.shared.gguf_architectures import GgufMetadata

# GGUF ``general.architecture`` -> the gridserve architecture built for it (``gguf_architectures``).
ARCHITECTURES = {name: arch.hf_class for name, arch in GGUF_ARCHITECTURES.items()}
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
    """The config.json-like dict of the GGUF file at ``path``: the architecture's own fields
    (``gguf_architectures``) and what every one shares (vocabulary, tied head, context, token ids,
    dtype), checked: architecture and tensor types supported, the keys the model needs present."""
    gguf_file = read_gguf(path)
    arch = gguf_architecture(gguf_file)
    check_tensor_types(gguf_file)
    meta = GgufMetadata(gguf_file, arch)
    if meta.has("rope_freqs.weight"):
        raise ConfigError("model.model", f"{str(path)!r}: tensor 'rope_freqs.weight' (llama3-style "
                                         "RoPE frequencies) is not supported for GGUF files yet")
    embed = meta.tensors.get("token_embd.weight")
    if embed is None:
        raise ConfigError("model.model", f"{str(path)!r}: tensor 'token_embd.weight' is missing")
    architecture = GGUF_ARCHITECTURES[arch]
    config: dict[str, Any] = {
        "architectures": [architecture.hf_class],
        "model_type": architecture.model_type,
        **architecture.build(meta),
        "vocab_size": int(embed.shape[0]),  # the embedding's rows (padded vocabularies included)
        # No separate output matrix: the LM head is the embedding (llama.cpp does the same).
        "tie_word_embeddings": not meta.has("output.weight"),
        "dtype": SERVING_DTYPE,
        "gguf": {"architecture": arch},
    }
    config.setdefault("max_position_embeddings", int(meta.get("context_length", 2048)))
    if config["max_position_embeddings"] is None:  # no position limit (ALiBi): as a config.json without one
        del config["max_position_embeddings"]
    for key, hf_key in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                        ("padding_token_id", "pad_token_id")):
        value: Optional[int] = gguf_file.get(f"tokenizer.ggml.{key}")
        if value is not None:
            config[hf_key] = int(value)
    return config


