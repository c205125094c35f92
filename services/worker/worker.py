"""Worker: one device. Sets it up, measures the memory left for the KV cache, owns the ModelRunner.

A worker of a tensor / pipeline parallel group joins its peers' torch.distributed rendezvous in
``init_device`` (NCCL on CUDA, gloo on CPU) before the model is built, so each rank builds its shard.

The executor (in-process or over gRPC) calls these methods by name; each is one entry of the
worker's fixed method allow-list, plus ``call_extension`` for the worker extension's methods.
"""

from __future__ import annotations

import ctypes
import logging
import os
from typing import Any, Optional

import torch

from gridserve.kernels import dispatch
from gridserve.services.worker import cpu_packed_linear
from gridserve.services.worker.cuda_graphs import GRAPH_MEMORY_RESERVE, uses_cuda_graphs
from gridserve.services.worker.fused_moe import expert_parameter_bytes
from gridserve.services.worker.memory import MemoryUsage
from gridserve.services.worker.model_runner import ModelRunner
from gridserve.services.worker.parallel_state import (
    ParallelState,
    get_parallel_state,
    init_distributed,
    init_expert_parallel,
    set_parallel_state,
)
from gridserve.shared import envs
from gridserve.shared.config import GridserveConfig
from gridserve.shared.errors import ConfigError, PermissionDeniedError
from gridserve.shared.kv_cache_spec import KVCacheConfig, LayerKVCacheSpec
from gridserve.shared.lora import LoRARequest
from gridserve.shared.parallel import RankLayout
from gridserve.shared.scheduler_output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_CACHE_BYTES = 2 << 30

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4


def keep_large_allocations() -> None:
    """Make glibc keep freed large buffers instead of returning them to the OS.

    Every step allocates tensors of tens of MB (KV gathers, prefill activations). By default glibc
    serves each from a fresh ``mmap`` and unmaps it on free, so every step pays page faults for
    memory it just released (measured: a 150 MB KV gather 240 ms -> 35 ms with this setting).
    vLLM's CPU backend gets the same effect by preloading tcmalloc.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_MAX, 0)
        libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)
    except (OSError, AttributeError):
        logger.debug("glibc mallopt unavailable; keeping the default allocator settings")


def release_freed_memory(device: torch.device) -> None:
    """Hand freed memory back: the CUDA caching allocator's blocks, or glibc's free heap pages
    (``keep_large_allocations`` keeps them otherwise)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        logger.debug("glibc malloc_trim unavailable")


class Worker:
    """Device setup, memory profiling and sleep / wake-up around one ``ModelRunner``."""

    def __init__(self, config: GridserveConfig, rank: int = 0, local_rank: int = 0,
                 distributed_init_address: str = "") -> None:
        self.config = config
        self.rank = rank
        self.local_rank = local_rank
        p = config.parallel
        self.layout = RankLayout(rank, p.tensor_parallel_size, p.pipeline_parallel_size)
        self.distributed_init_address = distributed_init_address
        self.device: Optional[torch.device] = None
        self.runner: Optional[ModelRunner] = None
        self.kv_cache_config: Optional[KVCacheConfig] = None  # the engine's plan, kept for wake-up
        self._sleeping_weights: Optional[dict[str, torch.Tensor]] = None

    def init_device(self) -> None:
        p = self.config.parallel
        wanted = self.config.device.device
        if wanted == "auto":
            wanted = "cuda" if torch.cuda.is_available() else "cpu"
        if wanted == "cuda":
            self.device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
            threads = envs.GRIDSERVE_CPU_THREADS or (os.cpu_count() or 1)
            torch.set_num_threads(threads)
            if envs.GRIDSERVE_CPU_MALLOC_TUNING:
                keep_large_allocations()
        if self.layout.world_size > 1:
            if not self.distributed_init_address:
                raise ConfigError("parallel.distributed_init_address", "workers of a group need a rendezvous address")
            init_distributed(self.layout, self.distributed_init_address, self.device)
        else:
            set_parallel_state(ParallelState.single())
        if p.expert_parallel_size > 1:
            self._init_expert_parallel()
        torch.manual_seed(self.config.model.seed)
        self.runner = ModelRunner(self.config, self.device)

    def _init_expert_parallel(self) -> None:
        """Join the DP-wide expert-parallel group (after the engine's own TP / PP world)."""
        p = self.config.parallel
        if self.device.type == "cuda" and not self.config.device.enforce_eager:
            logger.info("expert parallelism: CUDA graphs off (a captured step cannot wait on other engines)")
            self.config.device.enforce_eager = True
        ep = init_expert_parallel(self.layout, p.data_parallel_rank, p.data_parallel_size,
                                  p.expert_parallel_init_address, self.device)
        get_parallel_state().ep = ep

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def load_model(self) -> None:
        self.runner.load_model()
        expert_bytes, held = expert_parameter_bytes(self.runner.model)
        if held:
            logger.info("rank %d (dp %d): %s per MoE layer, expert parameter bytes %d", self.rank,
                        self.config.parallel.data_parallel_rank, held, expert_bytes)
        dispatch.prepare(self.device)  # compile the C++ CPU kernels before serving, not mid-request

    def determine_available_memory(self) -> int:
        """Bytes the KV cache may use: the configured budget, or on GPU what a profiling run leaves."""
        budget = self.config.cache.kv_cache_memory_bytes
        if budget is not None:
            return budget
        if self.device.type != "cuda":
            return CPU_DEFAULT_KV_CACHE_BYTES
        return self._profile_gpu_memory()

    def _profile_gpu_memory(self) -> int:
        from gridserve.shared.sampling_params import SamplingParams
        from gridserve.shared.scheduler_output import NewRequestData

        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        tokens = min(self.config.scheduler.max_num_batched_tokens, self.config.max_model_len)
        dummy = SchedulerOutput(
            scheduled_new_reqs=[NewRequestData("profile", [0] * tokens, SamplingParams(max_tokens=1), [], 0)],
            num_scheduled_tokens={"profile": tokens},
            total_num_scheduled_tokens=tokens,
        )
        self.runner.execute_model(dummy)
        self.runner.requests.clear()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        free, total = torch.cuda.mem_get_info()
        used_by_others = total - free - torch.cuda.memory_reserved()
        available = int(total * self.config.cache.gpu_memory_utilization) - peak - used_by_others
        dev = self.config.device
        if uses_cuda_graphs(self.device, dev.enforce_eager, dev.batch_invariant):
            available -= GRAPH_MEMORY_RESERVE  # decode-step graphs are captured later, into their own pool
        logger.info("GPU memory: total %.2f GiB, peak %.2f GiB, KV cache gets %.2f GiB",
                    total / 2**30, peak / 2**30, available / 2**30)
        return max(available, 0)

    def get_kv_cache_spec(self) -> list[LayerKVCacheSpec]:
        """What each of this worker's layers keeps in the KV cache."""
        return self.runner.get_kv_cache_spec()

    def initialize_cache(self, kv_cache_config: KVCacheConfig) -> None:
        self.kv_cache_config = kv_cache_config
        self.runner.initialize_cache(kv_cache_config)

    def execute_model(self, scheduler_output: SchedulerOutput) -> Optional[ModelRunnerOutput]:
        """The step's samples on the output rank; ``None`` (an empty ack) on every other rank."""
        return self.runner.execute_model(scheduler_output)

    def check_health(self) -> None:
        if self.runner is None or self.runner.model is None:
            raise RuntimeError("worker has no model loaded")

    def sleep(self, level: int = 1) -> dict[str, int]:
        """Level 1: move weights to host memory and drop the KV cache. Level 2: drop weights too.

        On CPU the weights already live in host memory: level 1 drops only the KV cache. Returns
        the memory before and after (``MemoryUsage``); freed host memory goes back to the OS.
        """
        before = MemoryUsage.now(self.device)
        self.runner.release_cache()
        model = self.runner.model
        if level >= 2:
            self._sleeping_weights = None
            cpu_packed_linear.release(model)  # oneDNN tensors cannot go to_empty
            model.to_empty(device="meta")
        elif self.device.type == "cuda":
            self._sleeping_weights = {k: v.to("cpu") for k, v in model.state_dict().items()}
            model.to_empty(device="meta")
        else:
            logger.info("sleep level 1 on CPU: the weights already live in host memory; dropping the KV cache")
        release_freed_memory(self.device)
        report = before.report(MemoryUsage.now(self.device))
        logger.info("sleep level %d: %s", level, report)
        return report

    def wake_up(self, tags: Optional[list[str]] = None) -> dict[str, int]:
        """Restore what ``sleep`` released: ``"weights"`` (from host memory, or reloaded after
        level 2) and ``"kv_cache"`` (reallocated, empty); no tags restores both."""
        before = MemoryUsage.now(self.device)
        tags = tags or ["weights", "kv_cache"]
        model = self.runner.model
        if "weights" in tags and next(model.parameters()).is_meta:
            if self._sleeping_weights is not None:
                model.to_empty(device=self.device)
                model.load_state_dict(self._sleeping_weights)
                self._sleeping_weights = None
            else:
                self.runner.load_model()
        if "kv_cache" in tags and not self.runner.kv_caches:
            self.runner.initialize_cache(self.kv_cache_config)
        report = before.report(MemoryUsage.now(self.device))
        logger.info("wake up %s: %s", ",".join(tags), report)
        return report

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Read an adapter into this worker's LoRA cache now (otherwise its first request does)."""
        self.runner.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> None:
        """Forget an adapter (the engine unloaded it); a later request on it would read it again."""
        self.runner.remove_lora(lora_int_id)

    def list_loras(self) -> list[int]:
        """The adapter ids this worker holds, least recently used first."""
        return self.runner.list_loras()

    def call_extension(self, method: str, args: list, kwargs: dict[str, Any]) -> Any:
        """A public method of the worker extension, by name. ``extension.worker_class`` overrides
        this in a worker with an extension mixed in; a plain worker has none to call."""
        raise PermissionDeniedError(f"{method!r}: this worker has no extension (--worker-extension-cls)")

    def shutdown(self) -> None:
        if self.runner is not None and self.runner.model is not None:
            self.runner.release_cache()
