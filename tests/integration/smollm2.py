"""The default model's GGUF for the eval tests, or the one rule for a missing tool
(``tests/missing_tool.py``: skipped on a developer's machine, failed under ``CI=true``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from gridserve.default_model import INSTALL_HINT, default_model_file
from gridserve.shared.errors import ModelNotFoundError
from tests.missing_tool import missing


def smollm2_gguf(*modules: str) -> Path:
    """The installed SmolLM2 GGUF, once ``accelerate`` (transformers' GGUF loading) and ``modules``
    are importable."""
    for module in ("accelerate", *modules):
        if importlib.util.find_spec(module) is None:
            missing(f"{module} is not installed")
    try:
        return default_model_file()
    except ModelNotFoundError:
        missing(f"the default model is not installed ({INSTALL_HINT})")
        raise
