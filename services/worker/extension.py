"""Worker extensions: ``--worker-extension-cls pkg.mod:Cls`` mixed into every worker.

The extension class becomes a base of the worker (vLLM's ``worker_extension_cls``), so its methods
see ``self.runner``, ``self.device`` and the rest. Its public methods, and only those, can be called
by name through the executor's ``collective_rpc`` (the engine's ``CollectiveRpc``); any other name
is PERMISSION_DENIED. The mixed class's ``call_extension`` method is this module's function:
``Worker`` itself knows no extension (so it never imports this module: no import cycle). Arguments and results cross the wire as plain data and typed tensors
(``shared/rpc/values.py``): ``TensorData`` arrives here as a torch tensor, and a tensor returned
goes back as ``TensorData``.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

import torch

from gridserve.services.worker.worker import Worker
from gridserve.shared.config import GridserveConfig
from gridserve.shared.errors import ConfigError, InvalidArgumentError, PermissionDeniedError
from gridserve.shared.rpc.values import TensorData

logger = logging.getLogger(__name__)

TORCH_DTYPES = {
    "int32": torch.int32,
    "int64": torch.int64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
_DTYPE_NAMES = {dtype: name for name, dtype in TORCH_DTYPES.items()}


def worker_class(config: GridserveConfig) -> type[Worker]:
    """``Worker``, or ``Worker`` with the configured extension mixed in."""
    target = config.parallel.worker_extension_cls
    if not target:
        return Worker
    extension = _import(target)
    clashes = sorted(extension_methods(extension) & {n for n in dir(Worker) if not n.startswith("__")})
    if clashes:
        raise ConfigError("parallel.worker_extension_cls",
                          f"{target} redefines worker methods: {', '.join(clashes)}")
    logger.info("worker extension %s: methods %s", target, ", ".join(sorted(extension_methods(extension))))
    return type(f"{extension.__name__}Worker", (Worker, extension),
                {"extension_cls": extension, "call_extension": call_extension})


def extension_methods(extension: type) -> set[str]:
    """The public methods an extension class defines (its own bases included, not ``object``'s)."""
    names = set()
    for klass in extension.__mro__:
        if klass is object:
            continue
        names.update(n for n, v in vars(klass).items() if not n.startswith("_") and callable(v))
    return names


def call_extension(worker: Worker, method: str, args: list, kwargs: dict[str, Any]) -> Any:
    """Run the extension's ``method`` on ``worker`` with tensors as torch tensors; tensors in the
    result come back as ``TensorData``."""
    extension = getattr(worker, "extension_cls", None)
    if extension is None:
        raise PermissionDeniedError(f"{method!r}: this worker has no extension (--worker-extension-cls)")
    if method not in extension_methods(extension):
        raise PermissionDeniedError(
            f"{method!r} is not a method of the worker extension {extension.__module__}:{extension.__qualname__}")
    result = getattr(worker, method)(*to_torch(args), **to_torch(kwargs))
    return to_wire(result)


def to_torch(value: Any) -> Any:
    """``TensorData`` (at any depth of lists / dicts) as torch tensors on the CPU."""
    if isinstance(value, TensorData):
        if not value.data:
            return torch.empty(value.shape, dtype=TORCH_DTYPES[value.dtype])
        return torch.frombuffer(bytearray(value.data), dtype=TORCH_DTYPES[value.dtype]).reshape(value.shape)
    if isinstance(value, list):
        return [to_torch(v) for v in value]
    if isinstance(value, dict):
        return {k: to_torch(v) for k, v in value.items()}
    return value


def to_wire(value: Any) -> Any:
    """Torch tensors (at any depth) as ``TensorData``; everything else as it is."""
    if isinstance(value, torch.Tensor):
        if value.dtype not in _DTYPE_NAMES:
            raise InvalidArgumentError("result", f"cannot send a {value.dtype} tensor")
        flat = value.detach().to("cpu").contiguous().reshape(-1)
        return TensorData(flat.view(torch.uint8).numpy().tobytes(), _DTYPE_NAMES[value.dtype], tuple(value.shape))
    if isinstance(value, (list, tuple)):
        return [to_wire(v) for v in value]
    if isinstance(value, dict):
        return {k: to_wire(v) for k, v in value.items()}
    return value


def _import(target: str) -> type:
    module_name, class_name = target.split(":")
    try:
        extension = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError("parallel.worker_extension_cls", f"cannot import {target}: {exc}") from None
    if not isinstance(extension, type):
        raise ConfigError("parallel.worker_extension_cls", f"{target} is not a class")
    return extension
