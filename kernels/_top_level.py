"""The top-level name ``kernels`` belongs to another distribution (Hugging Face's ``kernels``, a
dependency of transformers >= 5.25, which imports it when transformers loads); this checkout's
``kernels/`` folder is ``gridserve.kernels``.

A process started from the checkout's root (``python -m ...``, pytest) has that root on sys.path,
so ``import kernels`` would find this folder first. ``kernels/__init__.py`` then asks
``installed_kernels`` for the module the same import finds on sys.path without this checkout's root,
and puts it in its own place (``sys.modules["kernels"]``). Without one installed the folder stays
what the import found (older transformers probe the name by importing it and read no version from
it: not available, as before).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType
from typing import Optional


def installed_kernels(init_file: str) -> Optional[ModuleType]:
    """The installed ``kernels`` distribution's module, found on sys.path without the folder that
    holds this checkout's ``kernels/`` (``init_file`` is that package's ``__init__.py``), loaded and
    registered as ``sys.modules["kernels"]``; None when none is installed."""
    root = os.path.realpath(os.path.dirname(os.path.dirname(init_file)))
    path = [p for p in sys.path if os.path.realpath(p or os.getcwd()) != root]
    spec = importlib.machinery.PathFinder.find_spec("kernels", path)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["kernels"]
        raise
    return module
