"""``UniProcExecutor``: one worker in the engine's own process (offline ``LLM`` and tests).

The executor family stays together here, but the engine never imports a worker: whoever assembles
both roles in one process (``gridserve.llm_engine.in_process_executor``) hands this executor the
worker class, as services meet only through contracts and ``shared/``.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Optional, Union

from gridserve.services.engine.executor.base import (
    Executor,
    check_worker_method,
    is_extension_method,
)
from gridserve.shared.config import GridserveConfig
from gridserve.shared.errors import ConfigError, InvalidArgumentError


class UniProcExecutor(Executor):
    """Calls the worker's methods directly; ``non_block`` returns an already-completed future.

    ``worker_factory`` builds the worker from the config (the worker role's ``Worker``).
    """

    def __init__(self, config: GridserveConfig, worker_factory: Callable[[GridserveConfig], Any]) -> None:
        self.worker_factory = worker_factory
        super().__init__(config)

    def _init_executor(self) -> None:
        if self.config.parallel.world_size > 1:
            raise ConfigError(
                "parallel.executor_backend",
                "the in-process executor runs one worker; tensor / pipeline parallelism needs 'grpc'",
            )

        self.worker = self.worker_factory(self.config)
        self.worker.init_device()
        self.worker.load_model()

    def collective_rpc(
        self,
        method: str,
        timeout: Optional[float] = None,
        args: tuple = (),
        kwargs: Optional[dict[str, Any]] = None,
        non_block: bool = False,
        unique_reply_rank: Optional[int] = None,
    ) -> Union[list[Any], Any, Future]:
        check_worker_method(method)
        if unique_reply_rank not in (None, 0):
            raise InvalidArgumentError("unique_reply_rank", f"rank {unique_reply_rank} of 1 worker")
        future: Future = Future()
        try:
            if is_extension_method(method):
                result = self.worker.call_extension(method, list(args), dict(kwargs or {}))
            else:
                result = getattr(self.worker, method)(*args, **(kwargs or {}))
            future.set_result(result if unique_reply_rank is not None else [result])
        except Exception as exc:  # noqa: BLE001 - delivered through the future, like a remote worker
            if not non_block:
                raise
            future.set_exception(exc)
        return future if non_block else future.result()

    def shutdown(self) -> None:
        self.worker.shutdown()
