"""The engine's LoRA adapter table: served name -> ``LoRARequest`` (id and folder).

The table is the one source of truth about which adapters an engine serves: gateways list it
(``ListLoraAdapters``) to build ``/v1/models`` and to check a request's ``model``, and a request
names its adapter by ``lora_name`` only; the engine fills in the id and folder the workers need.

Loading asks every worker to load and check the adapter (``add_lora``: its rank, target modules and
files against the model), so a bad adapter is refused before it enters the table, naming the field.
Ids are handed out in increasing order and never reused (an unloaded adapter's id stays retired),
so a prefix-cache key ``(lora_name, lora_int_id)`` never matches another adapter's blocks.

Runs on the engine's loop thread (``EngineLoop.submit``) except ``resolve`` / ``list``, which the
gRPC handlers call directly: they read under the table's lock.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

from gridserve.shared.config import LoRAConfig
from gridserve.shared.errors import (
    AlreadyExistsError,
    FailedPreconditionError,
    InvalidArgumentError,
    ModelNotFoundError,
    PermissionDeniedError,
)
from gridserve.shared.lora import MAX_LORA_NAME, LoRARequest

logger = logging.getLogger(__name__)
MAX_LORA_PATH = 4096
MAX_ADAPTERS = 4096  # table entries: every adapter is a file read per worker, and a /v1/models row


@dataclass(frozen=True)
class LoadedAdapter:
    request: LoRARequest
    created: float  # Unix time it entered the table


class LoRAAdapters:
    """Adapters this engine serves; ``executor`` loads them on its workers."""

    def __init__(self, config: LoRAConfig, executor: Any) -> None:
        self.config = config
        self.executor = executor
        self._adapters: dict[str, LoadedAdapter] = {}
        self._next_id = 1
        self._lock = threading.Lock()
        self.started = time.time()  # a restarted engine's table holds only --lora-modules

    # ---- served adapters (gRPC) -----------------------------------------------------------
    def load_modules(self) -> None:
        """The adapters named at start (``--lora-modules``), loaded before the engine serves."""
        for name, path in self.config.lora_modules.items():
            self.load(name, path, runtime=False)

    def load(self, name: str, path: str, *, runtime: bool = True) -> LoadedAdapter:
        """Check ``name`` and ``path``, load the adapter on every worker, add it to the table.

        ``runtime``: asked for while serving (``LoadLoraAdapter``), which needs
        ``allow_runtime_lora_updating``; adapters given at start do not."""
        if runtime and not self.config.allow_runtime_lora_updating:
            raise PermissionDeniedError("loading LoRA adapters at run time is off: start the engine with "
                                        "--allow-runtime-lora-updating")
        _check_name(name)
        path = self._checked_path(path, runtime)
        with self._lock:
            if name in self._adapters:
                raise AlreadyExistsError(f"lora_name: the LoRA adapter {name!r} is already loaded")
            if len(self._adapters) >= MAX_ADAPTERS:
                raise InvalidArgumentError("lora_name", f"this engine serves at most {MAX_ADAPTERS} adapters")
            request = LoRARequest(name, self._next_id, path)
            self._next_id += 1  # spent even if the load fails: never reused
        self.executor.collective_rpc("add_lora", args=(request,))
        adapter = LoadedAdapter(request, time.time())
        with self._lock:
            self._adapters[name] = adapter
        logger.info("LoRA adapter %r (id %d) loaded from %s", name, request.lora_int_id, path)
        return adapter

    def unload(self, name: str, *, runtime: bool = True) -> None:
        """Remove ``name`` from the table and from the workers' caches. Requests already running on
        it finish (a worker reloads it from its folder if it needs it again)."""
        if runtime and not self.config.allow_runtime_lora_updating:
            raise PermissionDeniedError("unloading LoRA adapters at run time is off: start the engine with "
                                        "--allow-runtime-lora-updating")
        with self._lock:
            adapter = self._adapters.pop(name, None)
        if adapter is None:
            raise ModelNotFoundError(f"lora_name: no LoRA adapter {name!r:.300} is loaded")
        self.executor.collective_rpc("remove_lora", args=(adapter.request.lora_int_id,))
        logger.info("LoRA adapter %r (id %d) unloaded", name, adapter.request.lora_int_id)

    def resolve(self, name: str) -> LoRARequest:
        """The adapter a gateway's request names (NOT_FOUND when the table lacks it)."""
        with self._lock:
            adapter = self._adapters.get(name)
        if adapter is None:
            raise ModelNotFoundError(f"lora_request.lora_name: no LoRA adapter {name!r:.300} is loaded")
        return adapter.request

    def list(self) -> list[LoadedAdapter]:
        with self._lock:
            return list(self._adapters.values())

    # ---- offline (``LLM.generate(..., lora_request=)``) -------------------------------------
    def register(self, request: LoRARequest) -> LoRARequest:
        """An adapter the offline caller names directly (vLLM's ``LoRARequest``): loaded on the
        workers the first time its id is seen. A name or id already in the table must name the same
        adapter (the prefix cache and the workers' caches key by them)."""
        with self._lock:
            known = self._adapters.get(request.lora_name)
            same_id = next((a for a in self._adapters.values() if a.request.lora_int_id == request.lora_int_id), None)
        if known is not None and known.request.lora_int_id == request.lora_int_id:
            return known.request
        if known is not None or same_id is not None:
            raise InvalidArgumentError("lora_request", f"{request} conflicts with the loaded "
                                                       f"{(known or same_id).request}: one id per adapter name")
        if request.lora_int_id < self._next_id - 1 and request.lora_int_id in self._retired():
            raise InvalidArgumentError("lora_request.lora_int_id", f"id {request.lora_int_id} belonged to an "
                                       "unloaded adapter; ids are never reused")
        if not request.lora_path:
            raise InvalidArgumentError("lora_request.lora_path", "must name the adapter's folder")
        self.executor.collective_rpc("add_lora", args=(request,))
        with self._lock:
            self._adapters[request.lora_name] = LoadedAdapter(request, time.time())
            self._next_id = max(self._next_id, request.lora_int_id + 1)
        return request

    def _retired(self) -> set[int]:
        live = {a.request.lora_int_id for a in self._adapters.values()}
        return set(range(1, self._next_id)) - live

    def _checked_path(self, path: str, runtime: bool) -> str:
        """``path`` made absolute; inside ``lora_dir`` when one is set. At run time a ``lora_dir``
        is required: a client must not name arbitrary folders on the workers' hosts."""
        if not isinstance(path, str) or not path or len(path) > MAX_LORA_PATH or "\x00" in path:
            raise InvalidArgumentError("lora_path", f"must be a folder path of at most {MAX_LORA_PATH} characters")
        root = self.config.lora_dir
        if root is None:
            if runtime:
                raise FailedPreconditionError("loading adapters at run time needs --lora-dir (the folder "
                                              "adapter paths must lie in)")
            return os.path.abspath(path)
        root = os.path.realpath(root)
        full = os.path.realpath(os.path.join(root, path))  # a relative path is taken inside lora_dir
        if os.path.commonpath([root, full]) != root:
            raise InvalidArgumentError("lora_path", f"{path!r:.300} is outside the allowed directory --lora-dir")
        return full


def _check_name(name: str) -> None:
    if (not isinstance(name, str) or not name or len(name) > MAX_LORA_NAME or not name.isprintable()
            or name != name.strip()):
        raise InvalidArgumentError("lora_name", f"must be 1 to {MAX_LORA_NAME} printable characters without "
                                   f"surrounding spaces, got {name!r:.300}")


def adapter_for(table: Optional[LoRAAdapters], name: str) -> LoRARequest:
    """A gateway request's adapter: NOT_FOUND-free only when this engine serves LoRA and has it."""
    if table is None:
        raise InvalidArgumentError("lora_request", "this engine serves no LoRA adapters (start it with --enable-lora)")
    return table.resolve(name)
