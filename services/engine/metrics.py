"""The engine's Prometheus metrics, with vLLM's names.

Gauges and counters are read at scrape time from one ``EngineLoad`` snapshot (the same one the
``GetLoad`` load report is built from), so the busy loop pays nothing for them. Histograms get
their observations once per step from the step's ``StepStats``: one observation per scheduled step
(``vllm:iteration_tokens_total``) and a few per finished request (queue, prefill, decode, token
counts). ``gridserve:kv_cache_group_usage_perc`` is each KV cache group's share of the pool (labels
``kv_cache_group``: its index, ``kv_cache_group_name``: ``full``, ``sliding_window_4096``, ...; names
repeat when a kind is split into several groups). ``gridserve:engine_state`` is 1 for the engine's
readiness state and 0 for the others (read from its ``Readiness``, so a dead or sleeping engine says so). TTFT, inter-token latency and end-to-end latency are the gateway's: it sees them as the
client does. With a ``--kv-role`` (disaggregated prefill / decode) the ``gridserve:kv_transfer*``
families count transfers and bytes each way and the blocks a prefill engine holds for pulls.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Optional

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from gridserve.services.engine.scheduler import StepStats
from gridserve.shared.config import GridserveConfig
from gridserve.shared.load import EngineLoad
from gridserve.shared.observability.metrics import (
    REQUEST_LATENCY_BUCKETS,
    STEP_BUCKETS,
    one_two_five_buckets,
)
from gridserve.shared.readiness import State

LABELS = ("model_name", "engine")


class _SnapshotCollector:
    """Gauges and counters from one ``EngineLoad`` snapshot taken at scrape time."""

    def __init__(self, snapshot: Callable[[], Optional[EngineLoad]], labels: dict[str, str],
                 cache_info: dict[str, str], state: Optional[Callable[[], State]] = None) -> None:
        self.snapshot = snapshot
        self.state = state
        self.labels = labels
        self.cache_info = cache_info

    def collect(self):
        names, values = list(self.labels), list(self.labels.values())
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=[*names, *self.cache_info])
        info.add_metric([*values, *self.cache_info.values()], 1.0)
        yield info
        if self.state is not None:
            current = self.state()
            family = GaugeMetricFamily("gridserve:engine_state",
                                       "1 for the engine's readiness state (loading, ready, sleeping, draining, "
                                       "recovering, dead), 0 for the others.", labels=[*names, "state"])
            for state in State:
                family.add_metric([*values, state.value], 1.0 if state is current else 0.0)
            yield family
        stats = self.snapshot()
        if stats is None:  # the engine is starting or dead: only static families
            return
        for name, doc, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.", stats.num_running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", stats.num_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", stats.kv_cache_usage),
        ):
            family = GaugeMetricFamily(name, doc, labels=names)
            family.add_metric(values, value)
            yield family
        if stats.kv_cache_groups:
            family = GaugeMetricFamily(
                "gridserve:kv_cache_group_usage_perc",
                "Blocks one KV cache group holds / the pool's usable blocks (every group draws from one pool; "
                "vllm:kv_cache_usage_perc is the pool's total). kv_cache_group: the group's index (its block "
                "table); kv_cache_group_name: full, mla or sliding_window_<window>, shared by the groups a "
                "kind is split into.", labels=[*names, "kv_cache_group", "kv_cache_group_name"])
            total = stats.kv_total_blocks
            for index, (group, blocks) in enumerate(stats.kv_cache_groups):
                family.add_metric([*values, str(index), group], blocks / total if total else 0.0)
            yield family
        for name, doc, value in (
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", stats.num_prompt_tokens),
            ("vllm:generation_tokens", "Number of generation tokens processed.", stats.num_generation_tokens),
            ("vllm:num_preemptions", "Cumulative number of preemption from the engine.", stats.num_preemptions),
            ("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
             stats.prefix_cache_queries),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
             stats.prefix_cache_hits),
        ):
            family = CounterMetricFamily(name, doc, labels=names)
            family.add_metric(values, value)
            yield family
        if stats.spec_accepted_per_pos:  # speculative decoding is on
            yield from _spec_decode_families(stats, names, values)
        if stats.kv_transfers is not None:  # disaggregated prefill / decode: a kv_role
            yield from _kv_transfer_families(stats, names, values)
        if stats.max_lora:  # LoRA is on: vLLM's info gauge, the scrape time as its value
            family = GaugeMetricFamily(
                "vllm:lora_requests_info", "Running stats on lora requests (adapter names, comma separated).",
                labels=[*names, "max_lora", "running_lora_adapters", "waiting_lora_adapters"])
            family.add_metric([*values, str(stats.max_lora), ",".join(stats.running_lora_adapters),
                               ",".join(stats.waiting_lora_adapters)], time.time())
            yield family


def _spec_decode_families(stats: EngineLoad, names: list[str], values: list[str]):
    """vLLM's ``vllm:spec_decode_*`` counters: drafts verified (one per request and step), draft
    tokens, accepted tokens, and accepted tokens per draft position (``position`` label)."""
    for name, doc, value in (
        ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", stats.spec_num_drafts),
        ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", stats.spec_num_draft_tokens),
        ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.", stats.spec_num_accepted_tokens),
    ):
        family = CounterMetricFamily(name, doc, labels=names)
        family.add_metric(values, value)
        yield family
    family = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                 "Accepted tokens per draft position.", labels=[*names, "position"])
    for position, value in enumerate(stats.spec_accepted_per_pos):
        family.add_metric([*values, str(position)], value)
    yield family


def _kv_transfer_families(stats: EngineLoad, names: list[str], values: list[str]):
    """Disaggregated prefill / decode: the KV transfer counters, and what a producer holds now
    (``gridserve:kv_transfer_held_blocks`` back at 0 once every transfer was pulled or expired)."""
    kv = stats.kv_transfers
    for name, doc, value in (
        ("gridserve:kv_transfers_sent", "KV transfers a decode engine pulled whole from this prefill engine.",
         kv.transfers_sent),
        ("gridserve:kv_transfers_expired", "KV transfers freed at their deadline, never pulled.",
         kv.transfers_expired),
        ("gridserve:kv_transfers_released", "KV transfers freed unpulled at once: the gateway ended "
         "the request at its first token.", kv.transfers_released),
        ("gridserve:kv_transfers_received", "KV transfers this decode engine pulled.", kv.transfers_received),
        ("gridserve:kv_transfers_failed", "KV pulls that failed (the prompt was computed locally).",
         kv.transfers_failed),
        ("gridserve:kv_transfer_bytes_sent", "KV bytes served to decode engines.", kv.bytes_sent),
        ("gridserve:kv_transfer_bytes_received", "KV bytes pulled from prefill engines.", kv.bytes_received),
    ):
        family = CounterMetricFamily(name, doc, labels=[*names, "kv_role"])
        family.add_metric([*values, kv.kv_role], value)
        yield family
    for name, doc, value in (
        ("gridserve:kv_transfers_held", "KV transfers waiting for a decode engine to pull them.",
         kv.transfers_held),
        ("gridserve:kv_transfer_held_blocks", "KV blocks held for decode engines to pull.", kv.held_blocks),
    ):
        family = GaugeMetricFamily(name, doc, labels=[*names, "kv_role"])
        family.add_metric([*values, kv.kv_role], value)
        yield family


class EngineMetrics:
    """The engine's registry: snapshot gauges / counters and per-step histograms."""

    def __init__(self, config: GridserveConfig, snapshot: Callable[[], Optional[EngineLoad]],
                 engine: str = "0", registry: Optional[CollectorRegistry] = None,
                 state: Optional[Callable[[], State]] = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=False)
        labels = {"model_name": config.model.model, "engine": engine}
        cache = config.cache
        cache_info = {"block_size": str(cache.block_size), "num_gpu_blocks": str(cache.num_blocks or 0),
                      "enable_prefix_caching": str(cache.enable_prefix_caching)}
        self.registry.register(_SnapshotCollector(snapshot, labels, cache_info, state))

        def histogram(name: str, doc: str, buckets) -> Histogram:
            metric = Histogram(name, doc, LABELS, buckets=buckets, registry=self.registry)
            return metric.labels(**labels)

        token_buckets = one_two_five_buckets(config.max_model_len)
        self.queue_time = histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds",
                                      "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds",
                                     "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram("vllm:request_inference_time_seconds",
                                        "Histogram of time spent in RUNNING phase for request.",
                                        REQUEST_LATENCY_BUCKETS)
        self.prompt_tokens = histogram("vllm:request_prompt_tokens",
                                       "Number of prefill tokens processed.", token_buckets)
        self.generation_tokens = histogram("vllm:request_generation_tokens",
                                           "Number of generation tokens processed.", token_buckets)
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
            one_two_five_buckets(config.scheduler.max_num_batched_tokens or 2048))
        self.step_time = histogram("gridserve:engine_step_seconds",
                                   "Wall time of one EngineCore.step() on the busy loop.", STEP_BUCKETS)
        self.execute_time = histogram(
            "gridserve:collective_rpc_seconds",
            "Round trip of execute_model to the workers (submit to result), per step.", STEP_BUCKETS)

    def record_step(self, step: StepStats, step_seconds: Optional[float]) -> None:
        for tokens in step.iteration_tokens:
            self.iteration_tokens.observe(tokens)
        if step_seconds is not None:
            self.step_time.observe(step_seconds)
        for request in step.finished:
            self.prompt_tokens.observe(request.num_prompt_tokens)
            self.generation_tokens.observe(request.num_output_tokens)
            if request.scheduled_time is None:
                continue  # aborted while waiting: it never ran
            self.queue_time.observe(request.scheduled_time - request.arrival_time)
            end = request.finished_time or time.monotonic()
            self.inference_time.observe(end - request.scheduled_time)
            if request.first_token_time is not None:
                self.prefill_time.observe(request.first_token_time - request.scheduled_time)
                self.decode_time.observe(end - request.first_token_time)
