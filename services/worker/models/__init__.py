"""Model implementations, looked up by the ``architectures`` entry of the checkpoint's config.json.

The built-in architectures map to modules of this package; a plugin's (``ModelRegistry``) to its
``"module:Class"`` string, imported here, in the worker, the first time it is built. Every model is
built with the uniform ``cls(*, config, prefix)``; a class written for the old positional signature
``cls(config, prefix)`` is adapted, with a warning once per class.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import threading
import warnings
from typing import Optional

from gridserve.shared.config import GridserveConfig
from gridserve.shared.model_registry import ARCHITECTURES, ModelRegistry
from gridserve.shared.plugins import load_general_plugins

logger = logging.getLogger(__name__)

def supported_architectures() -> list[str]:
    load_general_plugins()
    return ModelRegistry.get_supported_archs()


def get_model_class(architecture: str, convert: Optional[str] = None) -> type:
    """The class for ``architecture``: a plugin's registration first, then the built-ins.

    ``convert="embed"`` (the pooling runner over a generative checkpoint, ``resolve_runner``): the
    decoder as an embedder (``adapters.as_embedding_model``); a pooling model stays itself."""
    if convert not in (None, "none", "embed"):
        raise ValueError(f"unknown convert {convert!r}")
    model_class = _model_class(architecture)
    if convert == "embed":
        from gridserve.services.worker.models.adapters import as_embedding_model

        return as_embedding_model(model_class)
    return model_class


def _model_class(architecture: str) -> type:
    load_general_plugins()
    ModelRegistry.check_architecture(architecture)
    target = ModelRegistry.registered(architecture)
    if isinstance(target, type):
        return target
    if target is None:
        module_name, class_name = ARCHITECTURES[architecture].module.split(":")
        module_name = f"{__name__}.{module_name}"
    else:
        module_name, class_name = target.split(":")
    return getattr(importlib.import_module(module_name), class_name)


_warned: set[type] = set()
_warned_lock = threading.Lock()


def construct_model(model_class: type, config: GridserveConfig, prefix: str = ""):
    """Build ``model_class`` for ``config``: ``cls(*, config, prefix)``, or the old positional
    ``cls(config, prefix)`` (a model written before the keyword-only signature), with a warning."""
    if _takes_keyword_config(model_class):
        return model_class(config=config, prefix=prefix)
    with _warned_lock:
        first = model_class not in _warned
        _warned.add(model_class)
    if first:
        message = (f"{model_class.__qualname__} uses the old constructor __init__(self, config, prefix); "
                   "adapted for now: declare __init__(self, *, config, prefix='')")
        logger.warning("%s", message)
        warnings.warn(message, DeprecationWarning, stacklevel=2)
    parameters = list(inspect.signature(model_class.__init__).parameters.values())[1:]
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return model_class(config, prefix) if len(positional) >= 2 else model_class(config)


def _takes_keyword_config(model_class: type) -> bool:
    parameters = inspect.signature(model_class.__init__).parameters
    config = parameters.get("config")
    return config is not None and config.kind == inspect.Parameter.KEYWORD_ONLY
