"""``EngineLoad``: one engine's load at one moment, the one type from the scheduler to the router.

The scheduler takes it as a snapshot between steps (``Scheduler.stats``); the engine's metrics read
its counters, ``GetLoad`` answers with it, the ``LoadReporter`` streams its routing part
(``routing_key``) to the DP coordinator, whose snapshots hand it on to every gateway's ``Router``.
Fields a hop does not carry keep their defaults there (the coordinator's snapshots carry waiting,
running and KV-cache usage only).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from gridserve.shared.kv_transfer import KVTransferStats


@dataclass(frozen=True)
class EngineLoad:
    num_waiting: int  # requests waiting to be scheduled
    num_running: int  # requests running
    kv_cache_usage: float  # fraction of KV blocks in use, in [0, 1]
    kv_free_blocks: int = 0
    kv_total_blocks: int = 0
    num_preemptions: int = 0  # counters since start, below
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_prompt_tokens: int = 0  # prompt tokens of requests that produced their first token
    num_generation_tokens: int = 0
    sleeping: bool = False
    state: str = "ready"  # the engine's Readiness state (gridserve.shared.readiness.State value)
    # (group name, blocks it holds) per KV cache group ("full", "sliding_window_4096", ...)
    kv_cache_groups: tuple[tuple[str, int], ...] = ()
    # Speculative decoding's counters (empty per-position counts: speculation off)
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    # Multi-LoRA (vllm:lora_requests_info): the adapters of running / waiting requests, by name;
    # max_lora 0: LoRA is off
    max_lora: int = 0
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    # Disaggregated prefill / decode: the KV transfer counters (None: the engine has no kv_role)
    kv_transfers: Optional[KVTransferStats] = None

    def routing_key(self) -> tuple[int, int, float]:
        """What routing looks at; a new report is worth sending (and publishing) when it changes."""
        return self.num_waiting, self.num_running, round(self.kv_cache_usage, 3)
