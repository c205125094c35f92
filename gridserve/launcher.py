"""``gridserve serve``: every role as a local OS process on loopback.

Starts N workers, then the engine (``--workers`` = their addresses), then A gateways, each in its
own process group, and waits for each one's ``grpc.health.v1`` to say SERVING (a worker only
becomes SERVING once its engine has loaded the model and allocated the KV cache on it). With an
``edge_port`` it then starts Envoy (role ``edge``, :mod:`gridserve.edge`) on that port in front of
every gateway, and waits until a gRPC health check through it answers SERVING. On
``stop()`` (SIGTERM / Ctrl-C) it stops them in reverse order (edge, gateways, engine, workers), each with
SIGTERM and a grace period, then SIGKILL; children also get SIGTERM if the launcher itself dies.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Optional

from gridserve.shared.rpc.client import health_status, make_channel, wait_until_serving

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = float(os.environ.get("GRIDSERVE_STARTUP_TIMEOUT_S", "600"))


@dataclass
class RoleProcess:
    role: str
    address: str
    process: subprocess.Popen
    log: Optional[IO] = None

    @property
    def pid(self) -> int:
        return self.process.pid


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


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
                 api_key: Optional[str] = None, edge_admin_port: Optional[int] = None) -> None:
        self.model = model
        self.engine_args = engine_args
        self.host = host
        self.grpc_port = grpc_port
        self.api_server_count = api_server_count
        self.num_workers = num_workers
        self.log_dir = log_dir
        self.grace_s = grace_s
        self.edge_port = edge_port
        self.served_model_name = served_model_name
        self.api_key = api_key
        self.edge_admin_port = edge_admin_port
        self._edge_dir: Optional[tempfile.TemporaryDirectory] = None
        self.processes: list[RoleProcess] = []
        self.exit_codes: dict[str, int] = {}  # "role-pid" -> exit status, filled by stop()

    # ---- start ------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start every role and wait until all are SERVING; on failure stop what started and raise."""
        try:
            workers = [self._spawn("worker", i, []) for i in range(self.num_workers)]
            for worker in workers:
                self._wait_reachable(worker)
            engine = self._spawn("engine", 0, ["--model", self.model, "--workers",
                                               ",".join(w.address for w in workers), *self.engine_args])
            self._wait_serving(engine)
            for i in range(self.api_server_count):
                port = self.grpc_port if (i == 0 and self.grpc_port) else None
                extra = ["--engines", engine.address]
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

    def _spawn(self, role: str, index: int, extra: list[str], port: Optional[int] = None,
               env: Optional[dict[str, str]] = None) -> RoleProcess:
        port = port or free_port(self.host)
        address = f"{self.host}:{port}"
        argv = [sys.executable, "-m", "gridserve.cli", role, "--host", self.host, "--port", str(port),
                "--grace-period", str(self.grace_s), *extra]
        log = None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
            log = open(self.log_dir / f"{role}-{index}.log", "ab")  # noqa: SIM115 - closed in stop()
        process = subprocess.Popen(_die_with_launcher(argv), stdout=log,
                                   stderr=subprocess.STDOUT if log else None, start_new_session=True,
                                   env={**os.environ, **env} if env else None)
        proc = RoleProcess(role, address, process, log)
        self.processes.append(proc)
        logger.info("started %s (pid %d) on %s", role, process.pid, address)
        return proc

    def _spawn_edge(self, port: int) -> RoleProcess:
        """Envoy on ``port`` in front of every gateway (config written next to the logs or to a temp dir)."""
        from gridserve.edge import envoy_argv, envoy_config, write_config

        if self.log_dir is not None:
            folder = self.log_dir
        else:
            self._edge_dir = tempfile.TemporaryDirectory(prefix="gridserve-edge-")
            folder = Path(self._edge_dir.name)
        config = write_config(folder / "edge-0.json", envoy_config(self.host, port, self.gateway_addresses,
                                                                   admin_port=self.edge_admin_port))
        log = None
        if self.log_dir is not None:
            log = open(self.log_dir / "edge-0.log", "ab")  # noqa: SIM115 - closed in stop()
        process = subprocess.Popen(_die_with_launcher(envoy_argv(config)), stdout=log, stderr=subprocess.STDOUT if log else None,
                                   start_new_session=True)
        proc = RoleProcess("edge", f"{self.host}:{port}", process, log)
        self.processes.append(proc)
        logger.info("started edge (envoy, pid %d) on %s", process.pid, proc.address)
        return proc

    def _check_alive(self, proc: RoleProcess) -> None:
        if proc.process.poll() is not None:
            raise RuntimeError(f"the {proc.role} (pid {proc.pid}) exited with {proc.process.returncode} "
                               f"during startup{self._log_hint(proc)}")

    def _log_hint(self, proc: RoleProcess) -> str:
        return f"; see {proc.log.name}" if proc.log is not None else ""

    def _wait_reachable(self, proc: RoleProcess) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        with make_channel(proc.address) as channel:
            while health_status(channel) == "UNREACHABLE":
                self._check_alive(proc)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the {proc.role} on {proc.address} did not start")
                time.sleep(0.1)

    def _wait_serving(self, proc: RoleProcess) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            self._check_alive(proc)
            try:
                wait_until_serving(proc.address, timeout=1.0)
                return
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise

    # ---- run and stop ---------------------------------------------------------------------------------
    @property
    def edge_address(self) -> Optional[str]:
        return next((p.address for p in self.processes if p.role == "edge"), None)

    @property
    def gateway_addresses(self) -> list[str]:
        return [p.address for p in self.processes if p.role == "gateway"]

    def table(self) -> str:
        lines = [f"{'role':<9}{'pid':>8}  address"]
        lines += [f"{p.role:<9}{p.pid:>8}  {p.address}" for p in self.processes]
        a, n = self.api_server_count, self.num_workers
        edge = " + 1 edge" if any(p.role == "edge" for p in self.processes) else ""
        lines.append(f"processes: A + DP + N = {a} + 1 + {n} = {a + 1 + n} (+1 coordinator when DP > 1){edge}")
        return "\n".join(lines)

    def wait(self) -> Optional[RoleProcess]:
        """Block until a role exits; return it (None if the launcher is stopping)."""
        while self.processes:
            for proc in self.processes:
                if proc.process.poll() is not None:
                    return proc
            time.sleep(0.2)
        return None

    def stop(self) -> None:
        """SIGTERM in reverse start order, grace period, then SIGKILL; wait for every child."""
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


def _signal_group(proc: RoleProcess, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
