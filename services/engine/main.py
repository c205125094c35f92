"""Entry point of the engine role: ``gridserve engine --workers ADDR,... --model MODEL``.

Connects to its worker services (GrpcExecutor), sizes and allocates the KV cache, starts the busy
loop and serves ``EngineCore``. SERVING once the workers hold the model and the cache; NOT_SERVING
when a worker dies or while draining on SIGTERM. With ``metrics_port`` it serves Prometheus
``/metrics``; with an OTLP endpoint it exports a span per request (queue, prefill, decode). When a
worker dies the engine stays up and RECOVERING (NOT_SERVING) for up to ``worker_recovery_timeout_s``
while the group is rebuilt (``EngineLoop``); ``gridserve:worker_recoveries_total`` counts recoveries.
"""

from __future__ import annotations

import logging
from typing import Optional

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from gridserve.api.engine.v1 import engine_pb2, engine_pb2_grpc
from gridserve.services.engine.core import EngineCore
from gridserve.services.engine.fault_injection import install_fault_injection
from gridserve.services.engine.load_reporter import LoadReporter
from gridserve.services.engine.loop import EngineLoop
from gridserve.services.engine.metrics import EngineMetrics
from gridserve.services.engine.observability import EngineObserver
from gridserve.services.engine.servicer import EngineServicer
from gridserve.services.engine.waves import WaveClient, is_moe
from gridserve.shared import envs
from gridserve.shared.config import GridserveConfig
from gridserve.shared.load import EngineLoad
from gridserve.shared.observability.metrics import start_metrics_server
from gridserve.shared.observability.tracing import Tracing
from gridserve.shared.plugins import load_general_plugins
from gridserve.shared.prefix_digest import PrefixDigest
from gridserve.shared.readiness import State
from gridserve.shared.rpc.server import RpcServer

logger = logging.getLogger(__name__)

SERVICE = engine_pb2.DESCRIPTOR.services_by_name["EngineCore"].full_name
SCRAPE_TIMEOUT_S = 5.0
# The busy loop beats every iteration (at least every 0.2 s when idle); tests shorten it.


def serve(config: GridserveConfig, host: str, port: int, grace_s: float = 10.0, *,
          metrics_port: Optional[int] = None, otlp_traces_endpoint: Optional[str] = None,
          coordinator: Optional[str] = None, data_parallel_rank: int = 0, data_parallel_size: int = 1,
          worker_recovery_timeout_s: float = 0.0, health_port: Optional[int] = None) -> int:
    """Run the engine until SIGTERM; ``config`` must name its workers (executor ``grpc``)."""
    load_general_plugins()  # plugins register in every process (lazy strings: no torch here)
    registry = CollectorRegistry(auto_describe=False)
    metrics_server = start_metrics_server(registry, host, metrics_port)
    tracing = Tracing.create("gridserve-engine", otlp_traces_endpoint)
    server = RpcServer(host, port, grace_s=grace_s, role="engine", health_port=health_port)  # every handler is async: no pool work
    if metrics_server is not None:
        server.register_metrics(registry)
    servicer = EngineServicer(config, metrics_port=metrics_server.port if metrics_server else 0,
                              tracing=tracing is not None)
    server.add_service(SERVICE, lambda s: engine_pb2_grpc.add_EngineCoreServicer_to_server(servicer, s))
    server.install_signal_handlers()
    server.start()  # answers health (NOT_SERVING) while the workers load
    # the workers' place in the expert-parallel group (--enable-expert-parallel)
    config.parallel.data_parallel_rank, config.parallel.data_parallel_size = data_parallel_rank, data_parallel_size
    if config.parallel.expert_parallel_size > 1 and worker_recovery_timeout_s:
        # one engine cannot rebuild its workers alone: the others' share its collectives' group
        logger.info("expert parallelism: a worker failure ends the engine (no worker recovery)")
        worker_recovery_timeout_s = 0.0
    core = EngineCore(config)
    metrics = None
    if metrics_server is not None:
        metrics = EngineMetrics(config, lambda: _snapshot(servicer), engine=str(data_parallel_rank),
                                registry=registry, state=lambda: server.readiness.state)
    observer = EngineObserver(metrics, tracing, engine=str(data_parallel_rank))
    observer.instrument(core.executor)
    waves = None
    if coordinator and data_parallel_size > 1 and is_moe(config.model.hf_config):
        # MoE: step in lockstep with the other engines (the client runs on the server's loop).
        waves = server.call(lambda: WaveClient(coordinator, data_parallel_rank))
    if waves is not None and metrics_server is not None:
        registry.register(_WaveMetrics(waves, str(data_parallel_rank)))
    # DP: the engine loop offers its load after every change; the reporter streams it to the coordinator.
    # With prefix caching its digest goes along: the blocks cached and evicted (cache-aware routing).
    reporter = None
    if coordinator:
        digest = None
        kv = core.kv_cache_manager
        if kv.enable_caching and config.model.runner != "pooling":
            digest = PrefixDigest(kv.block_size, kv.num_total_blocks)
            kv.watch_prefix_cache(digest)
        reporter = server.call(lambda: LoadReporter(coordinator, data_parallel_rank, server.address, digest=digest))
    loop = EngineLoop(core, server.readiness, observer=observer, waves=waves,
                      on_load=reporter.offer if reporter is not None else None,
                      recovery_timeout_s=worker_recovery_timeout_s)
    if metrics_server is not None:
        registry.register(_RecoveryMetrics(loop, str(data_parallel_rank)))
    core.executor.on_failure = loop.fail
    servicer.loop = loop
    install_fault_injection(loop)  # tests only (GRIDSERVE_TEST_HOOKS)

    def drain(timeout: float) -> None:
        loop.drain(timeout)
        core.shutdown()
        for client in (reporter, waves):  # on the server's loop, before it stops
            if client is not None:
                server.run(client.close())
        server.run(servicer.status.close())
        if tracing is not None:
            tracing.shutdown()

    server.on_drain = drain
    server.readiness.arm_watchdog(envs.GRIDSERVE_LOOP_WATCHDOG_S)
    server.readiness.set(State.READY, "workers loaded")
    logger.info("engine ready on %s: %d KV blocks", server.address, config.cache.num_blocks or 0)
    server.wait()
    if metrics_server is not None:
        metrics_server.stop()
    return 0


class _WaveMetrics:
    """``gridserve:wave_dummy_steps_total`` and ``gridserve:waves_completed_total`` (MoE with DP)."""

    def __init__(self, waves: WaveClient, engine: str) -> None:
        self.waves, self.engine = waves, engine

    def collect(self):
        for name, doc, value in (
            ("gridserve:wave_dummy_steps", "Empty steps run to keep an MoE wave in lockstep", self.waves.dummy_steps),
            ("gridserve:waves_completed", "MoE request waves this engine took part in", self.waves.waves_completed),
        ):
            family = CounterMetricFamily(name, doc, labels=["engine"])
            family.add_metric([self.engine], value)
            yield family


class _RecoveryMetrics:
    """``gridserve:worker_recoveries_total`` and the last recovery's duration."""

    def __init__(self, loop: EngineLoop, engine: str) -> None:
        self.loop, self.engine = loop, engine

    def collect(self):
        family = CounterMetricFamily("gridserve:worker_recoveries", "Worker-group failures the engine recovered from",
                                     labels=["engine"])
        family.add_metric([self.engine], self.loop.recoveries)
        yield family
        if self.loop.last_recovery_s is not None:
            gauge = GaugeMetricFamily("gridserve:worker_recovery_seconds",
                                      "Duration of the last worker-group recovery (failure to serving again)",
                                      labels=["engine"])
            gauge.add_metric([self.engine], self.loop.last_recovery_s)
            yield gauge


def _snapshot(servicer: EngineServicer) -> Optional[EngineLoad]:
    """The scheduler's stats for a scrape; None while the engine starts, sleeps a step away, or is dead."""
    try:
        return servicer.loop.stats().result(timeout=SCRAPE_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - a scrape must not fail because the engine is busy or dead
        return None
