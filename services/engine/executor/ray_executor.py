"""``RayExecutor``: the workers as Ray actors, driven like any worker service.

For people who run Ray clusters (KubeRay): the engine reserves a placement group (one bundle per
worker, in rank order; ``STRICT_PACK`` when there is one pipeline stage, so the tensor-parallel
group shares a node, ``PACK`` otherwise) and starts one actor per bundle. Each actor runs the
ordinary worker service (``python -m gridserve worker``) on its node, as its child: the actor
holds the devices Ray gave it (``CUDA_VISIBLE_DEVICES``), the worker process inherits them and dies
with the actor. From there it is ``GrpcExecutor``: the same ``CollectiveRPC`` streams, and a killed
actor is a worker death like any other: the whole group fails, and the engine's recovery rebuilds it
(``reinitialize``: new actors in a new placement group, since Ray restarts none at its old address). ``ray`` is an optional extra
(``pip install 'gridserve[ray]'``), imported only here; ``ray.init()`` joins ``RAY_ADDRESS`` or starts
a local instance unless the caller already did.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from typing import Any

from gridserve.services.engine.executor.grpc_executor import GrpcExecutor
from gridserve.shared import envs
from gridserve.shared.errors import ConfigError
from gridserve.shared.kv_cache_spec import KVCacheConfig
from gridserve.shared.ports import free_port
from gridserve.shared.rpc.server import insecure_internal_allowed, insecure_internal_env

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ConfigError("parallel.executor_backend",
                          "'ray' needs the ray package: pip install 'gridserve[ray]'") from None
    return ray


class WorkerHost:
    """A Ray actor that runs one worker service as its child process (defined with ``ray.remote``)."""

    def __init__(self) -> None:
        self.process: subprocess.Popen | None = None

    def start(self, env: dict[str, str]) -> str:
        """Start the worker on this node; its address."""
        host = _node_ip()
        port = free_port(host)
        argv = [sys.executable, "-m", "gridserve", "worker", "--host", host, "--port", str(port)]
        self.process = subprocess.Popen(argv, env={**os.environ, **env}, preexec_fn=_die_with_parent)
        return f"{host}:{port}"

    def rendezvous_address(self) -> str:
        """A free port on this node for the workers' torch.distributed rendezvous."""
        host = _node_ip()
        return f"{host}:{free_port(host)}"

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.terminate()
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


class RayExecutor(GrpcExecutor):
    """``GrpcExecutor`` over workers that Ray places and starts."""

    def _init_executor(self) -> None:
        self._own_rendezvous = not self.config.parallel.distributed_init_address
        self._place_and_start()
        try:
            super()._init_executor()
        except BaseException:
            self._release()
            raise

    def reinitialize(self, kv_cache_config: KVCacheConfig, timeout_s: float) -> None:
        """Ray does not bring a killed actor back at its address: the group gets new actors (a new
        placement group, new worker addresses and rendezvous), then is rebuilt as any worker group
        (device, weights, the same KV cache plan) within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        self._release()
        if self._own_rendezvous:
            self.config.parallel.distributed_init_address = None
        self._place_and_start()
        super().reinitialize(kv_cache_config, max(deadline - time.monotonic(), 1.0))

    def _place_and_start(self) -> None:
        """Reserve the placement group, start one worker-hosting actor per bundle, record the
        workers' addresses (and a rendezvous address on the first actor's node)."""
        ray = _import_ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        _check_plaintext_allowed()
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS") or None, include_dashboard=False)
        parallel = self.config.parallel
        device = self.config.device.device
        gpu = device == "cuda" or (device == "auto" and ray.cluster_resources().get("GPU", 0) >= 1)
        bundle = {"CPU": 1.0, **({"GPU": 1.0} if gpu else {})}
        strategy = "STRICT_PACK" if parallel.pipeline_parallel_size == 1 else "PACK"
        self.placement_group = placement_group([dict(bundle) for _ in range(parallel.world_size)], strategy=strategy)
        self._remove_placement_group = remove_placement_group
        self.actors: list[Any] = []
        try:
            ray.get(self.placement_group.ready(), timeout=60)
            host_class = ray.remote(num_cpus=1, num_gpus=1 if gpu else 0, max_restarts=0)(WorkerHost)
            for rank in range(parallel.world_size):
                strategy = PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=rank)
                self.actors.append(host_class.options(scheduling_strategy=strategy).remote())
            env = {"GRIDSERVE_CPU_THREADS": str(envs.GRIDSERVE_CPU_THREADS or 1)} if not gpu else {}
            env.update(insecure_internal_env())  # the engine's --insecure-internal, for its workers
            parallel.worker_addresses = ray.get([actor.start.remote(env) for actor in self.actors], timeout=120)
            if parallel.world_size > 1 and not parallel.distributed_init_address:
                parallel.distributed_init_address = ray.get(self.actors[0].rendezvous_address.remote(), timeout=60)
            logger.info("ray workers (%s): %s", strategy, ", ".join(parallel.worker_addresses))
        except BaseException:
            self._release()
            raise

    def _local_rank_of(self, rank: int) -> int:
        return 0  # each actor sees only the devices Ray gave it

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            self._release()

    def _release(self) -> None:
        ray = _import_ray()
        for actor in self.actors:
            try:
                ray.get(actor.stop.remote(), timeout=15)
            except Exception as exc:  # noqa: BLE001 - the actor may be gone already
                logger.info("ray worker stop: %s", exc)
            try:
                ray.kill(actor)
            except Exception as exc:  # noqa: BLE001 - already dead
                logger.info("ray kill: %s", exc)
        self.actors = []
        if getattr(self, "placement_group", None) is not None:
            self._remove_placement_group(self.placement_group)
            self.placement_group = None


def _check_plaintext_allowed() -> None:
    """Ray's workers listen on their node's address: in plaintext only with ``--insecure-internal``."""
    from gridserve.shared.rpc import tls

    if tls.active() is None and not insecure_internal_allowed():
        raise ConfigError("insecure-internal", "the Ray executor's workers listen on their node's address, in "
                          "plaintext without mutual TLS: accept that on a trusted network with --insecure-internal "
                          "(GRIDSERVE_INSECURE_INTERNAL=1)")


def _node_ip() -> str:
    import ray

    return ray.util.get_node_ip_address()


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the actor (its parent) dies."""
    import ctypes
    import signal

    ctypes.CDLL("libc.so.6").prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
