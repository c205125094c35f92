"""EngineCore: the busy loop's body. One ``step()`` = schedule -> execute -> update.

The core owns the scheduler and the KV-cache manager and drives the workers through an
``Executor``. It sizes the KV cache from the memory the workers report. No torch here.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from concurrent.futures import Future
from typing import Optional

from gridserve.services.engine.executor import Executor
from gridserve.services.engine.kv_cache_manager import KVCacheManager, num_blocks_for_memory
from gridserve.services.engine.request import Request
from gridserve.services.engine.scheduler import Scheduler, SchedulerStats
from gridserve.shared.config import GridserveConfig
from gridserve.shared.errors import ConfigError
from gridserve.shared.outputs import EngineCoreOutput
from gridserve.shared.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)


class EngineCore:
    """Schedules requests onto the workers and turns their samples into per-request outputs."""

    def __init__(self, config: GridserveConfig, executor: Optional[Executor] = None) -> None:
        self.config = config
        self.executor = executor or Executor.get_class(config)(config)
        num_blocks = self._initialize_kv_cache()
        self.kv_cache_manager = KVCacheManager(
            num_blocks, config.cache.block_size, config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(config, self.kv_cache_manager)
        self._in_flight: Optional[tuple[SchedulerOutput, Future]] = None

    def _initialize_kv_cache(self) -> int:
        cache = self.config.cache
        available = self.executor.determine_available_memory()
        num_blocks = num_blocks_for_memory(available, self.config.model.kv_bytes_per_token(), cache.block_size)
        if (num_blocks - 1) * cache.block_size < self.config.max_model_len:
            raise ConfigError(
                "cache.kv_cache_memory_bytes",
                f"the KV cache holds {(num_blocks - 1) * cache.block_size} tokens, fewer than "
                f"max_model_len={self.config.max_model_len}; give it more memory or lower max_model_len",
            )
        self.executor.initialize_cache(num_blocks)
        cache.num_blocks = num_blocks
        logger.info("KV cache: %d blocks of %d tokens (%.1f MiB)", num_blocks, cache.block_size, available / 2**20)
        return num_blocks

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        return self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self._in_flight is not None or self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        """Schedule and submit the next batch, then finish the previous one; return its new tokens.

        One step stays in flight: the next batch is scheduled while the worker runs the current one
        (its requests' next tokens count as placeholders, already held by the worker), so the
        engine's Python work overlaps the forward pass. The first call returns nothing.
        """
        submitted = None
        if self.scheduler.has_unfinished_requests():
            # Submitted even when empty: it carries the ids the worker must forget.
            scheduler_output = self.scheduler.schedule()
            submitted = (scheduler_output, self.executor.execute_model(scheduler_output, non_block=True))
        previous, self._in_flight = self._in_flight, submitted
        if previous is None:
            return []
        scheduler_output, future = previous
        return self.scheduler.update_from_output(scheduler_output, future.result())

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        if self.scheduler.has_unfinished_requests():
            raise RuntimeError("cannot sleep with requests in flight")
        self.kv_cache_manager.reset_prefix_cache()
        self.executor.sleep(level)

    def wake_up(self, tags: Optional[list[str]] = None) -> None:
        self.executor.wake_up(tags)

    def shutdown(self) -> None:
        self.executor.shutdown()
