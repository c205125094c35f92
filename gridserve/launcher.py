"""``gridserve serve``: every role as a local OS process on loopback.

Starts N = DP x PP x TP workers (with N > 1: a share of the CPU threads each, and a free loopback
port for their torch.distributed rendezvous), then the engine (``--workers`` = their addresses),
then A gateways, each in its own process group, and waits for each one's ``grpc.health.v1`` to say SERVING (a worker only
becomes SERVING once its engine has loaded the model and allocated the KV cache on it). With an
``edge_port`` it then starts Envoy (role ``edge``, :mod:`gridserve.edge`) on that port in front of
every gateway, and waits until a gRPC health check through it answers SERVING. Every role gets a
free ``--metrics-port`` (Prometheus ``/metrics``, in the process table; the edge serves the gateways'
at ``GET /metrics``) and the tracing / log flags of ``serve``. On
``stop()`` (SIGTERM / Ctrl-C) it stops them in reverse order (edge, gateways, engine, workers), each with
SIGTERM and a grace period, then SIGKILL; children also get SIGTERM if the launcher itself dies.

With ``tls`` it first makes a throwaway CA and one certificate per role (``gridserve.certificates``)
in a private directory removed by ``stop()``, scoped to a random deployment name: every role gets its
``--tls-*`` flags (mutual TLS on every link; ``--tls-deployment``: only this deployment's names
count), the launcher checks health with the ``admin`` certificate, and the edge talks mutual
TLS to the gateways with the ``edge`` one (taking only this deployment's gateway certificates) and
serves HTTPS / gRPC over TLS with it (or with ``ssl_files``, ``--ssl-certfile`` /
``--ssl-keyfile``, which also work without ``tls``).

Addresses: ``host`` (``serve --host``) is where the edge listens. Every other role (workers,
engines, the coordinator, the gateways, every ``--metrics-port``) listens on 127.0.0.1, unless
``tls`` or ``insecure_internal`` (``--insecure-internal``, handed on to each role) let them listen on
``host`` too; the workers' torch.distributed rendezvous always stays on 127.0.0.1 (it has no
authentication, and every worker is on this machine).

With ``disaggregated`` (P, D) (``serve --disaggregated P:D``) it starts P prefill engines
(``--kv-role kv_producer``) and D decode engines (``--kv-role kv_consumer``) as DP ranks behind one
coordinator; the gateways read each engine's role from ``GetInfo`` and split every request between
the two pools (``services/gateway/disaggregation.py``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Optional

from gridserve.edge import CorsPolicy, EdgeLimits
from gridserve.shared import envs
from gridserve.shared.ports import free_port  # noqa: F401 - tests and tools import it from here
from gridserve.shared.readiness import LIVENESS_SERVICE
from gridserve.shared.rpc.client import health_status, make_channel, wait_until_serving
from gridserve.shared.rpc.tls import TlsFiles

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"

RESTART_BACKOFF_S = (1.0, 30.0)  # first delay, cap: doubles with each failure in a row
CRASH_LOOP_RESTARTS = 5  # restarts in a row, each dying within CRASH_LOOP_WINDOW_S of its start
CRASH_LOOP_WINDOW_S = 60.0
LIVENESS_PERIOD_S = 5.0  # how often supervise() asks each role's liveness (a dead or hung one is restarted)
# Checks in a row a role that once answered may miss before it counts as hung (SIGSTOPped, deadlocked)
# and is killed and restarted: Kubernetes' liveness failureThreshold (3 x 5 s).
LIVENESS_FAILURE_THRESHOLD = 3
KV_CACHE_INFO_TIMEOUT_S = 2.0  # each engine's GetInfo for the table's KV cache lines


class RoleStartError(RuntimeError):
    """A role exited while the launcher waited for it to start (its own error is in its output)."""


@dataclass
class RoleProcess:
    role: str
    address: str
    process: subprocess.Popen
    log: Optional[IO] = None
    metrics_address: Optional[str] = None  # host:port of its Prometheus /metrics
    argv: tuple[str, ...] = ()  # how to start it again (same port, same log)
    env: Optional[dict[str, str]] = None
    group: Optional[int] = None  # DP rank of an engine and its workers: restarted together
    started_at: float = 0.0
    quick_failures: int = 0  # deaths in a row that came soon after a (re)start
    live_seen: bool = False  # its liveness answered since its last (re)start
    liveness_misses: int = 0  # liveness checks in a row it did not answer (a hung process)

    @property
    def pid(self) -> int:
        return self.process.pid


def _die_with_launcher(argv: list[str]) -> list[str]:
    """``argv`` run so that the child gets SIGTERM when the launcher dies (no role outlives it).

    setpriv (util-linux) sets the parent-death signal and execs the command. A ``preexec_fn`` would
    do the same, but forking a process whose gRPC threads are busy can block in gRPC's fork handlers.
    """
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        logger.debug("setpriv not found: children will not follow the launcher if it is killed")
        return argv
    return [setpriv, "--pdeathsig", "TERM", "--", *argv]


class Launcher:
    """Starts and stops one local deployment: A gateways + 1 engine + N workers."""

    def __init__(self, model: str, engine_args: list[str], *, host: str = "127.0.0.1",
                 grpc_port: Optional[int] = None, api_server_count: int = 1, num_workers: int = 1,
                 log_dir: Optional[Path] = None, grace_s: float = 10.0,
                 edge_port: Optional[int] = None, served_model_name: Optional[str] = None,
                 api_key: Optional[str] = None, edge_admin_port: Optional[int] = None,
                 edge_limits: Optional[EdgeLimits] = None, edge_cors: Optional[CorsPolicy] = None,
                 tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                 data_parallel_size: int = 1,
                 observability_args: Optional[list[str]] = None, metrics: bool = True,
                 gateway_args: Optional[list[str]] = None, tls: bool = False,
                 ssl_files: Optional[tuple[str, str]] = None, insecure_internal: bool = False,
                 disaggregated: Optional[tuple[int, int]] = None) -> None:
        self.model = model
        self.engine_args = engine_args
        self.host = host
        self.insecure_internal = insecure_internal
        # Plaintext never leaves loopback silently: without TLS the roles behind the edge listen on
        # 127.0.0.1 unless the operator said --insecure-internal.
        self.internal_host = host if (tls or insecure_internal) else LOOPBACK
        self.grpc_port = grpc_port
        self.api_server_count = api_server_count
        self.tensor_parallel_size = tensor_parallel_size
        # Disaggregated prefill / decode (P, D): P kv_producer engines then D kv_consumer engines,
        # DP ranks 0 .. P + D - 1 behind one coordinator; the gateways learn the roles from GetInfo.
        self.disaggregated = disaggregated
        self.data_parallel_size = sum(disaggregated) if disaggregated else data_parallel_size
        self.pipeline_parallel_size = pipeline_parallel_size
        self.num_workers = max(num_workers, tensor_parallel_size * pipeline_parallel_size)
        self.log_dir = log_dir
        self.grace_s = grace_s
        self.edge_port = edge_port
        self.served_model_name = served_model_name
        self.api_key = api_key
        self.edge_admin_port = edge_admin_port
        self.edge_limits = edge_limits or EdgeLimits()
        self.edge_cors = edge_cors or CorsPolicy()
        # --otlp-traces-endpoint / --log-format for every role; with ``metrics`` each role gets a
        # free --metrics-port (shown in the process table; the edge serves the gateways' at /metrics).
        self.observability_args = list(observability_args or [])
        self.metrics = metrics
        self.gateway_args = list(gateway_args or [])  # e.g. the request limits (gridserve gateway flags)
        self._edge_dir: Optional[tempfile.TemporaryDirectory] = None
        self.tls = tls
        self.ssl_files = ssl_files
        self.ca = None  # the throwaway CA (``tls``), made by start()
        self.certificates: dict[str, TlsFiles] = {}
        self.processes: list[RoleProcess] = []
        self._stopping = threading.Event()
        self._lock = threading.Lock()  # a restart and stop() never interleave
        self._next_liveness_check = 0.0
        self.exit_codes: dict[str, int] = {}  # "role-pid" -> exit status, filled by stop()
        self.kv_cache_lines: list[str] = []  # one per engine that answered GetInfo, filled by start()

    # ---- start ------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start every role and wait until all are SERVING; on failure stop what started and raise."""
        try:
            self._make_certificates()
            coordinator = None
            if self.data_parallel_size > 1:
                coordinator = self._spawn("coordinator", 0, ["--data-parallel-size", str(self.data_parallel_size)])
                self._wait_serving(coordinator)
            engines = []
            ray_workers = _flag_value(self.engine_args, "--distributed-executor-backend") == "ray"
            expert_parallel = self._expert_parallel_args()
            for rank in range(self.data_parallel_size):
                # With the Ray executor the engine has Ray place and start its workers.
                workers = [] if ray_workers else self._start_workers(rank)
                extra = ["--model", self.model, *self.engine_args, *self._parallel_args(rendezvous=not ray_workers),
                         *expert_parallel]
                if workers:
                    extra += ["--workers", ",".join(w.address for w in workers)]
                if coordinator is not None:
                    extra += ["--data-parallel-rank", str(rank), "--data-parallel-size", str(self.data_parallel_size),
                              "--coordinator", coordinator.address]
                if self.disaggregated:
                    extra += ["--kv-role", self.kv_role(rank)]
                engines.append(self._spawn("engine", rank, extra, group=rank))
            for engine in engines:  # they load their models at the same time
                self._wait_serving(engine)
            for i in range(self.api_server_count):
                port = self.grpc_port if (i == 0 and self.grpc_port) else None
                extra = ["--engines", ",".join(e.address for e in engines), *self.gateway_args]
                if coordinator is not None:
                    extra += ["--coordinator", coordinator.address]
                if self.served_model_name:
                    extra += ["--served-model-name", self.served_model_name]
                # The key travels in the environment, not on a command line anyone can read.
                env = {"GRIDSERVE_API_KEY": self.api_key} if self.api_key else None
                self._wait_serving(self._spawn("gateway", i, extra, port, env))
            for proc in self.processes:
                self._wait_serving(proc)
            if self.edge_port is not None:
                self._wait_serving(self._spawn_edge(self.edge_port))
        except BaseException:
            self.stop()
            raise
        self._fetch_kv_cache_lines()

    def start_workers(self) -> list[str]:
        """Start only the workers (the offline ``LLM`` runs the engine itself); return their addresses."""
        try:
            self._make_certificates()
            return [w.address for w in self._start_workers()]
        except BaseException:
            self.stop()
            raise

    def _make_certificates(self) -> None:
        if self.tls and self.ca is None:
            from gridserve.certificates import LocalCA

            # A deployment of its own: the roles take only names scoped to it (``authz.Deployment``).
            self.ca = LocalCA(deployment=f"serve-{os.urandom(4).hex()}")
            # One certificate per engine (its DP rank) and per gateway: the coordinator takes an
            # engine's load only for its own rank, and an engine keeps each gateway's streams apart.
            self.certificates = self.ca.issue_all({"engine": self.data_parallel_size,
                                                   "gateway": self.api_server_count})
            logger.info("mutual TLS: throwaway CA and role certificates in %s", self.ca.folder)

    def certificate_for(self, role: str, index: int) -> Optional[TlsFiles]:
        """The certificate of instance ``index`` of ``role``: its own (engines by DP rank, gateways),
        else the role's; None without ``tls``."""
        return self.certificates.get(f"{role}-{index}") or self.certificates.get(role)

    @property
    def admin_tls(self) -> Optional[TlsFiles]:
        """The certificate tools present to the roles (None without ``tls``)."""
        return self.certificates.get("admin")

    @property
    def edge_ca_file(self) -> Optional[str]:
        """The CA a client of the edge's HTTPS trusts (the throwaway CA), if the edge uses ours."""
        if self.ssl_files is None and self.ca is not None:
            return str(self.ca.ca_file)
        return None

    def _start_workers(self, dp_rank: int = 0) -> list[RoleProcess]:
        """The ``PP x TP`` workers of the engine of DP rank ``dp_rank``."""
        env = None
        total = self.num_workers * self.data_parallel_size
        if total > 1 and not envs.is_set("GRIDSERVE_CPU_THREADS"):
            # Several workers share this machine's cores: oversubscribed OpenMP threads stall badly.
            env = {"GRIDSERVE_CPU_THREADS": str(max(1, (os.cpu_count() or 1) // total))}
        first = dp_rank * self.num_workers
        workers = [self._spawn("worker", first + i, [], env=env, group=dp_rank)
                   for i in range(self.num_workers)]
        for worker in workers:
            self._wait_reachable(worker)
        return workers

    def _parallel_args(self, rendezvous: bool = True) -> list[str]:
        """The engine's parallel sizes (unless given) and a free loopback port for the workers'
        torch.distributed rendezvous (unless one was given, or ``rendezvous`` is off)."""
        if self.num_workers == 1:
            return []
        args = []
        for flag, value in (("--tensor-parallel-size", self.tensor_parallel_size),
                            ("--pipeline-parallel-size", self.pipeline_parallel_size)):
            if flag not in self.engine_args:
                args += [flag, str(value)]
        if rendezvous and "--distributed-init-address" not in self.engine_args:  # no authentication: loopback
            args += ["--distributed-init-address", f"{LOOPBACK}:{free_port(LOOPBACK)}"]
        return args

    @property
    def expert_parallel(self) -> bool:
        return self.data_parallel_size > 1 and "--enable-expert-parallel" in self.engine_args

    def _expert_parallel_args(self) -> list[str]:
        """With expert parallelism, one DP-wide rendezvous address for every engine's workers (a free
        loopback port, unless given)."""
        if not self.expert_parallel or "--expert-parallel-init-address" in self.engine_args:
            return []
        return ["--expert-parallel-init-address", f"{LOOPBACK}:{free_port(LOOPBACK)}"]

    def _experts_held(self, dp_rank: int) -> str:
        """Which experts the workers of DP rank ``dp_rank`` hold (the process table), from the
        model's config.json; empty without expert parallelism or a readable config."""
        if not self.expert_parallel:
            return ""
        try:
            config = json.loads((Path(self.model) / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return f"  experts: 1/{self.data_parallel_size}"
        count = next((config[k] for k in ("n_routed_experts", "num_experts", "num_local_experts")
                      if config.get(k)), 0)
        size = count // self.data_parallel_size
        return f"  experts [{dp_rank * size}, {(dp_rank + 1) * size}) of {count}"

    def kv_role(self, dp_rank: int) -> str:
        """Disaggregated prefill / decode: the ``--kv-role`` of the engine of ``dp_rank``."""
        return "kv_producer" if self.disaggregated and dp_rank < self.disaggregated[0] else "kv_consumer"

    def _spawn(self, role: str, index: int, extra: list[str], port: Optional[int] = None,
               env: Optional[dict[str, str]] = None, group: Optional[int] = None) -> RoleProcess:
        host = self.internal_host
        port = port or free_port(host)
        address = f"{host}:{port}"
        argv = [sys.executable, "-m", "gridserve.cli", role, "--host", host, "--port", str(port),
                "--grace-period", str(self.grace_s), *self.observability_args, *extra]
        files = self.certificate_for(role, index)
        if files is not None:
            argv += [*files.argv(), "--tls-deployment", self.ca.deployment]
        if self.insecure_internal:
            argv.append("--insecure-internal")
        metrics_address = None
        if self.metrics:
            metrics_port = free_port(host)
            metrics_address = f"{host}:{metrics_port}"
            argv += ["--metrics-port", str(metrics_port)]
        log = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log = open(self.log_dir / f"{role}-{index}.log", "ab")  # noqa: SIM115 - closed in stop()
        proc = RoleProcess(role, address, _popen(argv, log, env), log, metrics_address, tuple(argv), env,
                           group, time.monotonic())
        self.processes.append(proc)
        logger.info("started %s (pid %d) on %s", role, proc.pid, address)
        return proc

    def _spawn_edge(self, port: int) -> RoleProcess:
        """Envoy on ``port`` in front of every gateway (config written next to the logs or to a temp dir)."""
        from gridserve.edge import envoy_argv, envoy_config, write_config

        if self.log_dir is not None:
            folder = self.log_dir
        else:
            self._edge_dir = tempfile.TemporaryDirectory(prefix="gridserve-edge-")
            folder = Path(self._edge_dir.name)
        metrics = [p.metrics_address for p in self.processes if p.role == "gateway" and p.metrics_address]
        edge = self.certificates.get("edge")
        upstream = (str(edge.cert), str(edge.key), str(edge.ca)) if edge else None
        downstream = self.ssl_files or ((str(edge.cert), str(edge.key)) if edge else None)
        scope = self.ca.deployment if edge and self.ca is not None else None  # only this deployment's gateways
        config = write_config(folder / "edge-0.json", envoy_config(self.host, port, self.gateway_addresses,
                                                                   admin_port=self.edge_admin_port,
                                                                   metrics_addresses=metrics,
                                                                   limits=self.edge_limits, cors=self.edge_cors,
                                                                   downstream_tls=downstream,
                                                                   upstream_tls=upstream, tls_deployment=scope))
        log = None
        if self.log_dir is not None:
            log = open(self.log_dir / "edge-0.log", "ab")  # noqa: SIM115 - closed in stop()
        argv = envoy_argv(config)
        process = _popen(argv, log, None)
        proc = RoleProcess("edge", f"{self.host}:{port}", process, log, argv=tuple(argv),
                           started_at=time.monotonic())
        self.processes.append(proc)
        logger.info("started edge (envoy, pid %d) on %s", process.pid, proc.address)
        return proc

    def _fetch_kv_cache_lines(self) -> None:
        """Ask each engine once for its KV cache plan (``GetInfo``) for ``table()``; an engine that does
        not answer only leaves its line out (the deployment is up: nothing here may fail it)."""
        self.kv_cache_lines = []
        for index, proc in enumerate(p for p in self.processes if p.role == "engine"):
            try:
                from gridserve.api.engine.v1 import engine_pb2, engine_pb2_grpc

                with make_channel(proc.address, self.admin_tls) as channel:
                    info = engine_pb2_grpc.EngineCoreStub(channel).GetInfo(
                        engine_pb2.GetInfoRequest(), timeout=KV_CACHE_INFO_TIMEOUT_S)
                self.kv_cache_lines.append(kv_cache_line(index, info))
            except Exception as exc:  # noqa: BLE001 - a missing table line must never stop serve
                logger.info("no KV cache line for engine %d (%s): %s", index, proc.address, exc)

    def _check_alive(self, proc: RoleProcess) -> None:
        if proc.process.poll() is not None:
            raise RoleStartError(f"the {proc.role} (pid {proc.pid}) exited with {proc.process.returncode} "
                                 f"during startup{self._log_hint(proc)}")

    def _log_hint(self, proc: RoleProcess, lines: int = 15) -> str:
        """Where its log is, and the log's last ``lines`` lines (why it died, without opening the file)."""
        if proc.log is None:
            return ""
        try:
            tail = Path(proc.log.name).read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            tail = []
        text = "".join(f"\n  | {line}" for line in tail)
        return f"; see {proc.log.name}" + (f", which ends:{text}" if text else "")

    def _wait_reachable(self, proc: RoleProcess) -> None:
        deadline = time.monotonic() + envs.GRIDSERVE_STARTUP_TIMEOUT_S
        with make_channel(proc.address, self.admin_tls) as channel:
            while health_status(channel) == "UNREACHABLE":
                self._check_alive(proc)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the {proc.role} on {proc.address} did not start")
                time.sleep(0.1)

    def _wait_serving(self, proc: RoleProcess) -> None:
        deadline = time.monotonic() + envs.GRIDSERVE_STARTUP_TIMEOUT_S
        tls = self.admin_tls
        if proc.role == "edge" and (self.ssl_files or tls):
            if self.edge_ca_file is None:  # an operator's certificate: wait for REST /health over HTTPS
                return self._wait_https(proc, deadline)
            tls = TlsFiles(tls.cert, tls.key, Path(self.edge_ca_file))
        while True:
            self._check_alive(proc)
            try:
                wait_until_serving(proc.address, timeout=1.0, tls=tls)
                return
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise

    def _wait_https(self, proc: RoleProcess, deadline: float) -> None:
        """The edge with a certificate we cannot verify: wait until ``GET /health`` answers 200."""
        import httpx2

        while True:
            self._check_alive(proc)
            try:
                if httpx2.get(f"https://{proc.address}/health", verify=False, timeout=1.0).status_code == 200:
                    return
            except httpx2.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the edge on {proc.address} did not answer /health over HTTPS")
            time.sleep(0.2)

    # ---- run and stop ---------------------------------------------------------------------------------
    @property
    def edge_address(self) -> Optional[str]:
        return next((p.address for p in self.processes if p.role == "edge"), None)

    @property
    def gateway_addresses(self) -> list[str]:
        return [p.address for p in self.processes if p.role == "gateway"]

    def table(self) -> str:
        lines = [f"{'role':<11}{'pid':>8}  {'address':<21}  metrics"]
        worker_index, engine_index = 0, 0
        for p in self.processes:
            metrics = f"http://{p.metrics_address}/metrics" if p.metrics_address else "-"
            if p.role == "edge" and any(q.metrics_address for q in self.processes):
                metrics = f"http://{p.address}/metrics"
            line = f"{p.role:<11}{p.pid:>8}  {p.address:<21}  {metrics}"
            if p.role == "worker" and self.num_workers * self.data_parallel_size > 1:
                tp, rank = self.tensor_parallel_size, worker_index % self.num_workers
                line += f"  dp {worker_index // self.num_workers}, rank {rank} (pp {rank // tp}, tp {rank % tp})"
                line += self._experts_held(worker_index // self.num_workers)
                worker_index += 1
            if p.role == "engine" and self.data_parallel_size > 1:
                line += f"  dp {engine_index}"
                if self.disaggregated:
                    line += f", {self.kv_role(engine_index)}"
                engine_index += 1
            lines.append(line)
        a, dp = self.api_server_count, self.data_parallel_size
        n = dp * self.num_workers
        coordinator = 1 if dp > 1 else 0
        edge = " + 1 edge" if any(p.role == "edge" for p in self.processes) else ""
        lines.append(f"processes: A + DP + N (+1 coordinator when DP > 1) = {a} + {dp} + {n}"
                     f"{' + 1' if coordinator else ''} = {a + dp + n + coordinator}{edge}")
        lines.append(f"workers: N = DP x PP x TP = {dp} x {self.pipeline_parallel_size} x "
                     f"{self.tensor_parallel_size} = {n}")
        lines += self.kv_cache_lines
        return "\n".join(lines)

    def supervise(self, poll_s: float = 0.2) -> Optional[RoleProcess]:
        """Keep the deployment running until ``stop()``: restart each role that dies, as a Kubernetes
        restart policy would, and return only when one keeps failing at start (the role returned).

        A gateway, the coordinator, the edge or a worker is restarted alone, on the same address with
        the same arguments: gateways reconnect to engines, engines and gateways to the coordinator,
        the edge health-checks the gateways back in, and an engine whose worker died keeps running
        and rebuilds its worker group once the worker is back (``--worker-recovery-timeout``; the
        other ranks of a parallel group leave when the engine closes their streams, and are
        restarted the same way), so its in-flight requests only pause. A dead engine restarts with
        its workers (it initializes them at start, and ranks of a parallel group cannot be reused),
        and so does one that runs but is dead (its liveness health says NOT_SERVING: its workers
        did not come back within the recovery timeout).
        Delays double from ``RESTART_BACKOFF_S[0]`` to its cap while deaths follow quickly after
        starts; after ``CRASH_LOOP_RESTARTS`` such deaths in a row the deployment gives up.
        """
        while self.processes and not self._stopping.is_set():
            dead = next((p for p in self.processes if p.process.poll() is not None), None)
            dead = dead or self._not_live()
            if dead is None:
                time.sleep(poll_s)
                continue
            quick = time.monotonic() - dead.started_at < CRASH_LOOP_WINDOW_S
            dead.quick_failures = dead.quick_failures + 1 if quick else 1
            logger.error("%s (pid %d) %s%s", dead.role, dead.pid,
                         "is not live (its liveness check failed)" if dead.process.poll() is None
                         else f"exited with {dead.process.returncode}", self._log_hint(dead))
            if dead.quick_failures > CRASH_LOOP_RESTARTS:
                logger.error("%s keeps failing at start (%d times in a row): giving up", dead.role,
                             dead.quick_failures - 1)
                return dead
            delay = min(RESTART_BACKOFF_S[0] * 2 ** (dead.quick_failures - 1), RESTART_BACKOFF_S[1])
            group = [p for p in self.processes
                     if dead.role == "engine" and dead.group is not None and p.group == dead.group]
            with self._lock:
                if not self._stopping.is_set():
                    self._restart(group or [dead], delay, dead.quick_failures)
        return None

    def _not_live(self) -> Optional[RoleProcess]:
        """A role whose process runs but is not live, as a Kubernetes liveness probe would find it;
        asked every ``LIVENESS_PERIOD_S``: an engine whose liveness says NOT_SERVING (it is DEAD:
        e.g. its worker group did not come back in time), or any gRPC role that answered once and
        then missed ``LIVENESS_FAILURE_THRESHOLD`` checks in a row (hung: SIGSTOPped, deadlocked —
        its peers' keepalive pings notice it within seconds, but only a restart frees its port)."""
        now = time.monotonic()
        if now < self._next_liveness_check:
            return None
        self._next_liveness_check = now + LIVENESS_PERIOD_S
        for proc in self.processes:
            if proc.role == "edge" or proc.process.poll() is not None:
                continue
            with make_channel(proc.address, self.admin_tls) as channel:
                status = health_status(channel, LIVENESS_SERVICE, timeout=1.0)
            if status == "UNREACHABLE":
                proc.liveness_misses += proc.live_seen
                if proc.liveness_misses >= LIVENESS_FAILURE_THRESHOLD:
                    logger.error("%s (pid %d) did not answer its liveness check %d times in a row",
                                 proc.role, proc.pid, proc.liveness_misses)
                    return proc
                continue
            proc.live_seen, proc.liveness_misses = True, 0
            if proc.role == "engine" and status == "NOT_SERVING":
                return proc
        return None

    def _restart(self, procs: list[RoleProcess], delay: float, failures: int) -> None:
        """Stop what is left of ``procs``, wait ``delay``, start them again (workers first)."""
        for proc in procs:
            if proc.process.poll() is None:
                _signal_group(proc, signal.SIGKILL)
                proc.process.wait()
            _signal_group(proc, signal.SIGKILL)
        logger.warning("restarting %s in %.1f s", ", ".join(f"{p.role} {p.address}" for p in procs), delay)
        if self._stopping.wait(delay):
            return
        for proc in sorted(procs, key=lambda p: p.role != "worker"):
            if proc.role == "engine":  # its workers must answer before it initializes them
                for worker in (p for p in procs if p.role == "worker"):
                    try:
                        self._wait_reachable(worker)
                    except (RuntimeError, TimeoutError) as exc:
                        logger.warning("%s", exc)  # its death is handled on the next round
            proc.process = _popen(list(proc.argv), proc.log, proc.env)
            proc.started_at = time.monotonic()
            proc.live_seen, proc.liveness_misses = False, 0
            proc.quick_failures = failures
            logger.info("restarted %s (pid %d) on %s", proc.role, proc.pid, proc.address)

    def stop(self) -> None:
        """SIGTERM in reverse start order, grace period, then SIGKILL; wait for every child."""
        self._stopping.set()  # a supervising thread restarts nothing from now on
        with self._lock:
            self._stop()

    def _stop(self) -> None:
        for proc in reversed(self.processes):
            if proc.process.poll() is None:
                _signal_group(proc, signal.SIGTERM)
                try:
                    proc.process.wait(timeout=self.grace_s + 10)
                except subprocess.TimeoutExpired:
                    logger.warning("%s (pid %d) ignored SIGTERM: killing it", proc.role, proc.pid)
                    _signal_group(proc, signal.SIGKILL)
                    proc.process.wait()
            self.exit_codes[f"{proc.role}-{proc.pid}"] = proc.process.returncode
            _signal_group(proc, signal.SIGKILL)  # anything the role itself started
            if proc.log is not None:
                proc.log.close()
        self.processes = []
        if self._edge_dir is not None:
            self._edge_dir.cleanup()
            self._edge_dir = None
        if self.ca is not None:
            self.ca.cleanup()
            self.ca, self.certificates = None, {}


def kv_cache_line(index: int, info) -> str:
    """``kv cache (engine 0): 2 groups: full x13 layers, sliding_window_16 x13 layers; 4,095 blocks of
    16 tokens`` from an engine's ``GetInfoResponse``."""
    groups = list(info.kv_cache_groups)
    described = ""
    if groups:
        described = (f"{len(groups)} group{'s' if len(groups) != 1 else ''}: "
                     + ", ".join(f"{g.name} x{g.num_layers} layers" for g in groups) + "; ")
    return f"kv cache (engine {index}): {described}{info.num_kv_blocks:,} blocks of {info.block_size} tokens"


def _popen(argv: list[str], log: Optional[IO], env: Optional[dict[str, str]]) -> subprocess.Popen:
    return subprocess.Popen(_die_with_launcher(argv), stdout=log, stderr=subprocess.STDOUT if log else None,
                            start_new_session=True, env={**os.environ, **env} if env else None)


def _signal_group(proc: RoleProcess, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _flag_value(argv: list[str], flag: str) -> Optional[str]:
    """The value after ``flag`` in ``argv`` (``--flag value`` or ``--flag=value``), or None."""
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None
