"""``ModelRegistry``: which architectures a worker can build, and where an out-of-tree one lives.

The checkpoint's ``config.json`` names its architecture (``LlamaForCausalLM``); the worker builds
the class registered under that name. Built-in architectures live in the worker role
(``services/worker/models``); plugins add theirs with ``register_model`` as a lazy ``"module:Class"``
string, so every process can register and check a model (the gateway and the engine too, which
never import torch) while only the worker imports it. A class object may be registered as well, in
a process that runs the worker itself (offline ``LLM``).
"""

from __future__ import annotations

import logging
import re
import threading
from typing import Union

from gridserve.shared.errors import ConfigError, InvalidArgumentError

logger = logging.getLogger(__name__)

# The worker role's own models (``services/worker/models/__init__.py`` maps each to its class).
BUILTIN_ARCHITECTURES = (
    "LlamaForCausalLM",
    "LlavaForConditionalGeneration",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "OPTForCausalLM",
    "Qwen2ForCausalLM",
)

_TARGET = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class _ModelRegistry:
    """Architecture name -> the model registered for it by a plugin (built-ins are implicit)."""

    def __init__(self) -> None:
        self._models: dict[str, Union[str, type]] = {}
        self._lock = threading.Lock()

    def register_model(self, architecture: str, model_cls: Union[str, type]) -> None:
        """Register ``model_cls`` (``"package.module:Class"``, imported only by the worker, or the
        class itself) for checkpoints whose ``architectures`` names ``architecture``. A plugin may
        replace a built-in (logged)."""
        if not isinstance(architecture, str) or not architecture.isidentifier():
            raise InvalidArgumentError("architecture", f"must be a class name, got {architecture!r}")
        if isinstance(model_cls, str):
            if not _TARGET.match(model_cls):
                raise InvalidArgumentError("model_cls", f"must be 'package.module:Class', got {model_cls!r}")
        elif not isinstance(model_cls, type):
            raise InvalidArgumentError("model_cls", f"must be a 'module:Class' string or a class, got {model_cls!r}")
        with self._lock:
            if architecture in BUILTIN_ARCHITECTURES or architecture in self._models:
                logger.warning("model architecture %s is now served by %s", architecture, _name(model_cls))
            self._models[architecture] = model_cls

    def get_supported_archs(self) -> list[str]:
        """Every architecture a worker can build: the built-ins and the registered ones."""
        with self._lock:
            return sorted(set(BUILTIN_ARCHITECTURES) | set(self._models))

    def is_supported(self, architecture: str) -> bool:
        return architecture in BUILTIN_ARCHITECTURES or architecture in self._models

    def registered(self, architecture: str) -> Union[str, type, None]:
        """What a plugin registered for ``architecture`` (None: a built-in or nothing)."""
        with self._lock:
            return self._models.get(architecture)

    def check_architecture(self, architecture: str) -> None:
        """Refuse an architecture nobody registered, naming the ones that are."""
        if not self.is_supported(architecture):
            raise ConfigError(
                "model.architecture",
                f"{architecture or '(none in config.json)'!r} is not a registered architecture; "
                f"registered: {', '.join(self.get_supported_archs())}",
            )

    def unregister(self, architecture: str) -> None:
        """Forget a plugin's model (tests)."""
        with self._lock:
            self._models.pop(architecture, None)


def _name(model_cls: Union[str, type]) -> str:
    return model_cls if isinstance(model_cls, str) else f"{model_cls.__module__}:{model_cls.__qualname__}"


ModelRegistry = _ModelRegistry()
