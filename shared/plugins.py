"""General plugins: the ``gridserve.general_plugins`` entry points, run once in every process.

A plugin is a package that declares, in its ``pyproject.toml``::

    [project.entry-points."gridserve.general_plugins"]
    my_models = "my_pkg:register"

and whose ``register()`` calls ``gridserve.ModelRegistry.register_model(...)`` (vLLM's
``vllm.general_plugins``). Every role calls ``load_general_plugins()`` as it starts, the gateway
and the engine included, so the function must only register lazy strings: a plugin whose model
imports torch still loads in a torch-free process. ``GRIDSERVE_PLUGINS`` (comma-separated entry
point names) limits which run; unset runs all, empty runs none.
"""

from __future__ import annotations

import logging
import threading
from importlib.metadata import entry_points

from gridserve.shared import envs

logger = logging.getLogger(__name__)

PLUGIN_GROUP = "gridserve.general_plugins"
PLUGINS_ENV = "GRIDSERVE_PLUGINS"


class _PluginLoader:
    """Runs each plugin's entry point once per process (later calls are no-ops)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.loaded: list[str] | None = None

    def load(self) -> list[str]:
        with self._lock:
            if self.loaded is None:
                self.loaded = _run_plugins()
            return list(self.loaded)


def _run_plugins() -> list[str]:
    allowed = envs.GRIDSERVE_PLUGINS
    names = None if allowed is None else {n.strip() for n in allowed.split(",") if n.strip()}
    loaded = []
    for entry in entry_points(group=PLUGIN_GROUP):
        if names is not None and entry.name not in names:
            continue
        try:
            entry.load()()
        except Exception:  # noqa: BLE001 - one broken plugin must not stop the role; it is logged
            logger.exception("plugin %s (%s) failed to load", entry.name, entry.value)
            continue
        loaded.append(entry.name)
        logger.info("loaded plugin %s (%s)", entry.name, entry.value)
    return loaded


_loader = _PluginLoader()


def load_general_plugins() -> list[str]:
    """Run every ``gridserve.general_plugins`` entry point (once per process); their names."""
    return _loader.load()
