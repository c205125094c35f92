"""The top-level name ``kernels`` belongs to another distribution (Hugging Face's ``kernels``, a
dependency of recent transformers); this checkout's ``kernels/`` folder is ``gridserve.kernels``.

A process started from the checkout's root (``python -m ...``, pytest) has that root on sys.path,
so ``import kernels`` would find this folder first. ``kernels/__init__.py`` then calls
``load_real_kernels``: the module that the same import finds on sys.path without this checkout's
root, loaded and returned in its place (``sys.modules["kernels"]``), or ``ModuleNotFoundError`` as
Python gives for a module that is not installed.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys
from types import ModuleType


def load_real_kernels(init_file: str) -> ModuleType:
    """The installed ``kernels`` distribution's module, found on sys.path without the folder that
    holds this checkout's ``kernels/`` (``init_file`` is that package's ``__init__.py``)."""
    root = os.path.realpath(os.path.dirname(os.path.dirname(init_file)))
    path = [p for p in sys.path if os.path.realpath(p or os.getcwd()) != root]
    spec = importlib.machinery.PathFinder.find_spec("kernels", path)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError("No module named 'kernels' (this checkout's kernels/ folder is "
                                  "gridserve.kernels)", name="kernels")
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module
    spec.loader.exec_module(module)
    return module
