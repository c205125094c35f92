"""The model's sampling defaults: what a request gets for the sampling fields it leaves out.

As vLLM does (``--generation-config``), a checkpoint's ``generation_config.json`` carries its
creator's recommended sampling: ``auto`` (the default) reads the model folder's file, ``vllm``
ignores it (``SamplingParams``' own neutral defaults), and a folder reads that folder's file. Of
the file only the sampling fields count: ``temperature``, ``top_p``, ``top_k``, ``min_p``,
``repetition_penalty``, and ``max_new_tokens`` as ``max_tokens`` (the default length of a request
that gives none); ``do_sample``, the special tokens and every other key are not sampling defaults.
A request that sets a field keeps its value. A ``.gguf`` checkpoint has no such file: no defaults.

Read once when the engine (or offline ``LLM``) resolves the model, checked like a request's values
(a bad one fails at start, naming the key); JSON only, no transformers and no torch.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional

from gridserve.shared.errors import ConfigError, InvalidArgumentError
from gridserve.shared.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

FILE_NAME = "generation_config.json"
# The modes besides a folder: the model's own file, or none at all.
MODES = ("auto", "vllm")
FIELD = "model.generation_config"
# generation_config.json key -> the SamplingParams field it is the default of, and its type.
_KEYS: dict[str, tuple[str, type]] = {
    "temperature": ("temperature", float),
    "top_p": ("top_p", float),
    "top_k": ("top_k", int),
    "min_p": ("min_p", float),
    "repetition_penalty": ("repetition_penalty", float),
    "max_new_tokens": ("max_tokens", int),
}
# Every SamplingParams field a default may be given for.
DEFAULT_FIELDS = tuple(name for name, _ in _KEYS.values())


def check_generation_config(value: Any) -> None:
    """``auto``, ``vllm`` or a folder path (whether it exists is checked where the model resolves)."""
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(FIELD, f"must be auto, vllm or a folder holding a {FILE_NAME}, got {value!r}")


def generation_config_file(model_path: str, generation_config: str) -> Optional[Path]:
    """The file the defaults come from: None with ``vllm`` or when the model has none."""
    if generation_config == "vllm":
        return None
    if generation_config == "auto":
        file = Path(model_path) / FILE_NAME  # a .gguf file is no folder: no such file
        return file if file.is_file() else None
    given = Path(generation_config).expanduser()
    file = given if given.is_file() else given / FILE_NAME
    if not file.is_file():
        raise ConfigError(FIELD, f"{generation_config!r} is not a folder holding a {FILE_NAME} "
                          f"(give auto for the model's own, vllm for none)")
    return file


def read_default_sampling_params(model_path: str, generation_config: str = "auto") -> dict[str, Any]:
    """The sampling defaults ``generation_config`` gives for the model at ``model_path``, as
    ``SamplingParams`` keywords (empty: none), checked; logged once when there are some."""
    file = generation_config_file(model_path, generation_config)
    if file is None:
        return {}
    defaults = _defaults_in(file, _load(file))
    if defaults:
        logger.info("the model's generation config (%s) overrides the default sampling parameters: %s; a "
                    "request that sets a field keeps its value (--generation-config vllm ignores the file)",
                    file, ", ".join(f"{k}={v}" for k, v in defaults.items()))
    return defaults


def _load(file: Path) -> dict[str, Any]:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(FIELD, f"cannot read {file}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(FIELD, f"{file} must hold a JSON object, got {type(data).__name__}")
    return data


def _defaults_in(file: Path, data: dict[str, Any]) -> dict[str, Any]:
    """The sampling keys of ``data`` (null ones skipped) as SamplingParams keywords, checked."""
    defaults: dict[str, Any] = {}
    for key, (name, kind) in _KEYS.items():
        value = data.get(key)
        if value is None:
            continue
        if not _is_a(value, kind):
            expected = "an integer" if kind is int else "a number"
            raise ConfigError(f"{FIELD}.{key}", f"{file} sets {value!r}: expected {expected}")
        defaults[name] = kind(value)
    try:
        SamplingParams(**defaults)
    except InvalidArgumentError as exc:
        name = exc.field.removeprefix("sampling_params.")
        key = next((k for k, (n, _) in _KEYS.items() if n == name), name)
        raise ConfigError(f"{FIELD}.{key}", f"{file}: {exc.message}") from None
    return defaults


def _is_a(value: Any, kind: type) -> bool:
    """A 32-bit int for an integer key (what the engine's protobuf carries), an int or a float
    for a number key; never a bool."""
    if isinstance(value, bool):
        return False
    if kind is int:
        return isinstance(value, int) and abs(value) < 2**31
    return isinstance(value, (int, float))
