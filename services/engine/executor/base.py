"""The ``Executor`` contract: the engine's only way to reach its workers.

An executor runs a named worker method on every worker (``collective_rpc``) and returns each
worker's answer, or a future of them with ``non_block=True`` so the engine can schedule the next
step while this one runs. Only the output rank's ``execute_model`` result matters to the engine.
Remote backends are chosen by ``Executor.get_class`` and imported lazily; the in-process one
(``uniproc``) needs the worker class, which only code that assembles both roles may import, so that
code builds it and hands it to ``EngineCore`` (the engine, torch-free, never imports a worker).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import Any, Optional, Union

from gridserve.shared.config import GridserveConfig
from gridserve.shared.errors import (
    ConfigError,
    EngineDeadError,
    InvalidArgumentError,
    PermissionDeniedError,
)
from gridserve.shared.kv_cache_spec import KVCacheConfig, LayerKVCacheSpec
from gridserve.shared.scheduler_output import ModelRunnerOutput, SchedulerOutput

# The fixed allow-list of worker methods an executor may call.
WORKER_METHODS = frozenset(
    {
        "init_device",
        "load_model",
        "get_kv_cache_spec",
        "determine_available_memory",
        "initialize_cache",
        "execute_model",
        "check_health",
        "sleep",
        "wake_up",
        "shutdown",
        "add_lora",
        "remove_lora",
        "list_loras",
    }
)

# What sleep releases and wake_up restores, by tag.
SLEEP_TAGS = ("weights", "kv_cache")


def check_worker_method(method: str) -> None:
    """A built-in worker method, or a name the worker extension may define (the worker decides)."""
    if method in WORKER_METHODS:
        return
    if not method.isidentifier():
        raise InvalidArgumentError("method", f"{method!r} is not a method name")
    if method.startswith("_"):
        raise PermissionDeniedError(f"{method!r} is private: only the extension's public methods are callable")


def is_extension_method(method: str) -> bool:
    """Whether ``collective_rpc(method)`` goes to the worker extension (not a built-in method)."""
    return method not in WORKER_METHODS


_BACKENDS = {
    "grpc": "gridserve.services.engine.executor.grpc_executor:GrpcExecutor",
    "ray": "gridserve.services.engine.executor.ray_executor:RayExecutor",
}


class Executor(ABC):
    """Drives the workers of one engine; the engine never knows which implementation it has."""

    def __init__(self, config: GridserveConfig) -> None:
        self.config = config
        self.sleeping_tags: set[str] = set()  # what sleep released and wake_up has not restored
        self._init_executor()

    @staticmethod
    def get_class(config: GridserveConfig) -> type[Executor]:
        backend = config.parallel.executor_backend
        if backend == "uni":
            raise ConfigError("parallel.executor_backend",
                              "the in-process executor runs a worker in this process: it is built by "
                              "gridserve.llm_engine.in_process_executor and passed to EngineCore")
        target = _BACKENDS.get(backend)
        if target is None:
            raise ConfigError("parallel.executor_backend", f"unknown executor {backend!r}")
        module_name, class_name = target.split(":")
        return getattr(importlib.import_module(module_name), class_name)

    @property
    def max_concurrent_batches(self) -> int:
        """Batches the workers can hold at once: one per pipeline stage."""
        return self.config.parallel.pipeline_parallel_size

    @abstractmethod
    def _init_executor(self) -> None:
        """Start or connect to the workers, set up their devices and load the model."""

    @abstractmethod
    def collective_rpc(
        self,
        method: str,
        timeout: Optional[float] = None,
        args: tuple = (),
        kwargs: Optional[dict[str, Any]] = None,
        non_block: bool = False,
        unique_reply_rank: Optional[int] = None,
    ) -> Union[list[Any], Any, Future]:
        """Run ``method`` on every worker; one result per worker (rank order), or only rank
        ``unique_reply_rank``'s. A built-in method (``WORKER_METHODS``) takes its domain arguments;
        any other name is a method of the worker extension, with plain data and ``TensorData``
        (``shared/rpc/values.py``) in and out, refused by the worker unless the extension defines it."""

    def execute_model(
        self, scheduler_output: SchedulerOutput, non_block: bool = False
    ) -> Union[ModelRunnerOutput, Future]:
        result = self.collective_rpc("execute_model", args=(scheduler_output,), non_block=non_block)
        if not non_block:
            return result[0]
        output: Future = Future()
        result.add_done_callback(lambda f: chain_first(f, output))
        return output

    def determine_available_memory(self) -> int:
        return min(self.collective_rpc("determine_available_memory"))

    def get_kv_cache_spec(self) -> list[list[LayerKVCacheSpec]]:
        """Each worker's layers: what each keeps in the KV cache (rank order)."""
        return self.collective_rpc("get_kv_cache_spec")

    def initialize_cache(self, kv_cache_config: KVCacheConfig) -> None:
        """Allocate the planned KV cache on every worker."""
        self.collective_rpc("initialize_cache", args=(kv_cache_config,))

    def check_health(self) -> None:
        self.collective_rpc("check_health", timeout=10.0)

    @property
    def is_sleeping(self) -> bool:
        return bool(self.sleeping_tags)

    @property
    def healthy(self) -> bool:
        """No worker failure is known since the group was (re)built."""
        return True

    def reinitialize(self, kv_cache_config: KVCacheConfig, timeout_s: float) -> None:
        """Rebuild the worker group after a failure (device, weights, the same KV cache plan),
        waiting up to ``timeout_s`` for its workers to be back; ``EngineDeadError`` when it cannot."""
        raise EngineDeadError(f"the {type(self).__name__} cannot rebuild its workers")

    def sleep(self, level: int = 1) -> list[dict[str, int]]:
        """Release the KV cache and the weights (offloaded at level 1, dropped at level 2); each
        worker's memory before and after. Asleep already: nothing to do."""
        if level not in (1, 2):
            raise InvalidArgumentError("level", f"must be 1 or 2, got {level}")
        if self.sleeping_tags:
            return []
        reports = self.collective_rpc("sleep", kwargs={"level": level})
        self.sleeping_tags = set(SLEEP_TAGS)
        return reports

    def wake_up(self, tags: Optional[list[str]] = None) -> list[dict[str, int]]:
        """Restore the sleeping ``tags`` (all when None); tags already awake are skipped."""
        tags = list(tags or SLEEP_TAGS)
        unknown = sorted(set(tags) - set(SLEEP_TAGS))
        if unknown:
            raise InvalidArgumentError("tags", f"unknown {unknown}; known: {list(SLEEP_TAGS)}")
        waking = [tag for tag in SLEEP_TAGS if tag in tags and tag in self.sleeping_tags]
        if not waking:
            return []
        reports = self.collective_rpc("wake_up", kwargs={"tags": waking})
        self.sleeping_tags -= set(waking)
        return reports

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the workers and release everything the executor holds."""


def chain_first(done: Future, output: Future) -> None:
    """Complete ``output`` with the first of ``done``'s per-worker results (or its error)."""
    exc = done.exception()
    if exc is not None:
        output.set_exception(exc)
    else:
        output.set_result(done.result()[0])
