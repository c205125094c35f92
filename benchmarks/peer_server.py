"""One peer server process for ``gridserve bench peer``: started in its own session on a free
loopback port, ready when an HTTP health path answers 200, stopped with SIGTERM to its process
group, then SIGKILL after a grace period. llama.cpp's ``llama-server`` (:mod:`llama_server`) and
vLLM's ``vllm serve`` (:mod:`vllm_server`) are subclasses that say how to start and what to poll.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import IO, Optional

from gridserve.shared.errors import GridserveError

logger = logging.getLogger(__name__)


class PeerSetupError(GridserveError, RuntimeError):
    """A peer server cannot be found, installed, built or started, or a checkpoint cannot be converted."""


class PeerServer:
    """A server process: ``argv()`` and ``env()`` say how to start it, ``health_path`` what to poll."""

    name = "peer"
    health_path = "/health"

    def __init__(self, *, log_path: Optional[Path] = None, host: str = "127.0.0.1", grace_s: float = 10.0) -> None:
        from gridserve.launcher import free_port

        self.host, self.log_path, self.grace_s = host, log_path, grace_s
        self.port = free_port(host)
        self.process: Optional[subprocess.Popen] = None
        self._log: Optional[IO] = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def argv(self) -> list[str]:
        raise NotImplementedError

    def env(self) -> Optional[dict[str, str]]:
        """The server's environment (``None``: this process's)."""
        return None

    def cwd(self) -> Optional[str]:
        """The server's working directory (``None``: this process's)."""
        return None

    def start(self, timeout_s: float = 600.0) -> PeerServer:
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        setpriv = shutil.which("setpriv")  # the server gets SIGTERM if this process dies
        argv = ([setpriv, "--pdeathsig", "TERM", "--"] if setpriv else []) + self.argv()
        logger.info("starting %s", " ".join(self.argv()))
        self.process = subprocess.Popen(argv, stdout=self._log or subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                        start_new_session=True, env=self.env(), cwd=self.cwd())
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        import httpx2

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                hint = f"; see {self.log_path}" if self.log_path else ""
                raise PeerSetupError(f"{self.name} exited with {self.process.returncode} at start{hint}")
            try:
                if httpx2.get(self.url + self.health_path, timeout=2.0, trust_env=False).status_code == 200:
                    return
            except httpx2.HTTPError:
                pass
            time.sleep(0.5)
        raise PeerSetupError(f"{self.name} on {self.url} not ready within {timeout_s:g}s")

    def pids(self) -> list[int]:
        """Every live process of the server's process group (the server and its workers)."""
        if self.process is None:
            return []
        out = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2:].split()  # after "pid (comm) ": state ppid pgrp ...
            if len(fields) > 2 and int(fields[2]) == self.process.pid:
                out.append(int(entry.name))
        return out or [self.process.pid]

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=self.grace_s)
            except subprocess.TimeoutExpired:
                logger.warning("%s (pid %d) ignored SIGTERM: killing it", self.name, self.process.pid)
                self._signal(signal.SIGKILL)
                self.process.wait()
        if self.process is not None:
            self._signal(signal.SIGKILL)  # workers left behind by a server that exited
        if self._log is not None:
            self._log.close()
            self._log = None

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.process.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def __enter__(self) -> PeerServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
