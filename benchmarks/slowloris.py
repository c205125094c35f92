"""``gridserve bench slowloris``: a normal client's latency at the edge while slow clients hold connections.

Starts one local deployment (worker, engine, gateway, Envoy) on loopback. A probe client sends
``GET /health`` (``--probe-path``) on a new connection every ``--probe-interval`` seconds, as a simple
client does. Phases alternate, idle then attack, ``--rounds`` times (so drift on a shared machine
hits both alike): in an attack phase ``--slow-clients`` connections trickle a request's headers
one byte per connection every ``--byte-interval`` seconds and never finish them (slowloris); the
edge cuts each after its headers timeout (``EdgeLimits.request_headers_timeout_s``, a 408) and the
attacker opens it again at once. Reports the probe's median and p99 latency idle and under attack,
the p99 ratio (the security issue's bar: at most 2x), and how the edge cut the slow connections
(how many, how, after how long). Loopback only, a bounded number of connections, a bounded time.
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import selectors
import socket
import statistics
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Optional

logger = logging.getLogger(__name__)

# Headers that never end: the request line and Host, then one made-up header after another, never
# the blank line that would finish them.
_HEAD = b"GET /health HTTP/1.1\r\nHost: edge\r\n"
_FILLER = b"X-Slow: aaaaaaaa\r\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF folder (default: the recipe's llama tiny)")
    parser.add_argument("--slow-clients", type=int, default=512, help="slow connections held during an attack")
    parser.add_argument("--byte-interval", type=float, default=0.5,
                        help="seconds between two header bytes of one slow connection")
    parser.add_argument("--phase-s", type=float, default=15.0,
                        help="seconds of each idle and each attack phase (longer than the headers timeout, so "
                             "the edge cuts slow connections during it)")
    parser.add_argument("--rounds", type=int, default=2, help="idle + attack rounds")
    parser.add_argument("--probe-path", default="/health", help="what the probe client GETs")
    parser.add_argument("--probe-interval", type=float, default=0.02, help="seconds between two probes")
    parser.add_argument("--request-headers-timeout", type=float, default=None,
                        help="the edge's headers timeout in seconds (default: EdgeLimits')")
    parser.add_argument("--output-json", default=None, help="write the results here")


class SlowClients:
    """``count`` connections to ``host:port`` trickling never-ending headers, one byte per
    connection every ``byte_interval_s``, from one thread. A connection the edge closes is
    recorded (``cuts``: its lifetime in seconds and how it ended, ``"408"`` or ``"closed"``) and
    opened again at once, until ``stop()``."""

    def __init__(self, host: str, port: int, count: int, byte_interval_s: float = 0.5) -> None:
        if count < 1 or byte_interval_s <= 0:
            raise ValueError("SlowClients needs count >= 1 and byte_interval_s > 0")
        self.address = (host, port)
        self.count = count
        self.byte_interval_s = byte_interval_s
        self.cuts: list[tuple[float, str]] = []
        self.opened = 0
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="slow-clients", daemon=True)
        self._selector = selectors.DefaultSelector()
        self._open: dict[socket.socket, tuple[float, int]] = {}  # socket -> (opened at, bytes sent)

    def __enter__(self) -> SlowClients:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def open_now(self) -> int:
        with self._lock:
            return len(self._open)

    def wait_open(self, timeout_s: float) -> bool:
        """Whether all ``count`` connections were open at once within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.open_now >= self.count:
                return True
            time.sleep(0.05)
        return False

    def stop(self) -> None:
        self._stopping.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def _connect(self) -> None:
        sock = socket.create_connection(self.address, timeout=5)
        sock.setblocking(False)
        self._selector.register(sock, selectors.EVENT_READ)
        with self._lock:
            self._open[sock] = (time.monotonic(), 0)
            self.opened += 1

    def _close(self, sock: socket.socket, how: Optional[str]) -> None:
        self._selector.unregister(sock)
        sock.close()
        with self._lock:
            opened_at, _ = self._open.pop(sock)
            if how is not None:
                self.cuts.append((time.monotonic() - opened_at, how))

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                while self.open_now < self.count and not self._stopping.is_set():
                    try:
                        self._connect()
                    except OSError:  # refused: try again next round
                        with self._lock:
                            self.cuts.append((0.0, "refused"))
                        break
                self._trickle()
                for key, _ in self._selector.select(timeout=self.byte_interval_s):
                    self._read(key.fileobj)
        finally:
            for sock in list(self._open):
                self._close(sock, None)
            self._selector.close()

    def _trickle(self) -> None:
        for sock, (opened_at, sent) in list(self._open.items()):
            data = _HEAD + _FILLER * (1 + sent // len(_FILLER))
            try:
                sock.send(data[sent:sent + 1])
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                self._close(sock, "closed")
                continue
            with self._lock:
                self._open[sock] = (opened_at, sent + 1)

    def _read(self, sock: socket.socket) -> None:
        if sock not in self._open:
            return
        try:
            answer = sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            answer = b""
        self._close(sock, "408" if answer.startswith(b"HTTP/1.1 408") else "closed")


def probe(host: str, port: int, path: str, until: float, interval_s: float) -> tuple[list[float], Counter]:
    """Latencies (seconds) of ``GET path``, each on a new connection, until ``until`` (monotonic);
    and the statuses (``"error"`` for a failed request)."""
    latencies: list[float] = []
    statuses: Counter = Counter()
    while time.monotonic() < until:
        start = time.perf_counter()
        conn = http.client.HTTPConnection(host, port, timeout=30)
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            resp.read()
            statuses[resp.status] += 1
        except OSError:
            statuses["error"] += 1
        finally:
            conn.close()
        latencies.append(time.perf_counter() - start)
        time.sleep(interval_s)
    return latencies, statuses


def _summary(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {"n": len(ordered), "median_ms": statistics.median(ordered) * 1e3,
            "p99_ms": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3}


def measure(host: str, port: int, args: argparse.Namespace) -> dict[str, object]:
    """Idle and attack phases, interleaved, against the edge on ``host:port``."""
    idle: list[float] = []
    attack: list[float] = []
    statuses = {"idle": Counter(), "attack": Counter()}
    cuts: list[tuple[float, str]] = []
    opened = held = 0
    for _ in range(args.rounds):
        samples, seen = probe(host, port, args.probe_path, time.monotonic() + args.phase_s, args.probe_interval)
        idle += samples
        statuses["idle"] += seen
        with SlowClients(host, port, args.slow_clients, args.byte_interval) as slow:
            if not slow.wait_open(60):
                logger.warning("only %d of %d slow connections opened", slow.open_now, args.slow_clients)
            held = max(held, slow.open_now)
            samples, seen = probe(host, port, args.probe_path, time.monotonic() + args.phase_s, args.probe_interval)
            attack += samples
            statuses["attack"] += seen
        cuts += slow.cuts
        opened += slow.opened
    lifetimes = [s for s, _ in cuts]
    return {
        "idle": _summary(idle), "attack": _summary(attack),
        "p99_ratio": _summary(attack)["p99_ms"] / _summary(idle)["p99_ms"],
        "median_ratio": _summary(attack)["median_ms"] / _summary(idle)["median_ms"],
        "probe_statuses": {k: {str(s): n for s, n in v.items()} for k, v in statuses.items()},
        "slow_connections": {"held_at_once": held, "opened": opened, "cut_by_edge": len(cuts),
                             "cut_how": dict(Counter(how for _, how in cuts)),
                             "lifetime_median_s": statistics.median(lifetimes) if lifetimes else None,
                             "lifetime_max_s": max(lifetimes) if lifetimes else None},
    }


def run(args: argparse.Namespace) -> int:
    import tempfile

    from gridserve.edge import EdgeLimits
    from gridserve.launcher import Launcher, free_port

    model = args.model
    if model is None:
        from gridserve.demo.recipe import ensure_checkpoint

        model = str(ensure_checkpoint("llama", "tiny"))
    limits = EdgeLimits() if args.request_headers_timeout is None else \
        EdgeLimits(request_headers_timeout_s=args.request_headers_timeout)
    with tempfile.TemporaryDirectory(prefix="gridserve-bench-slowloris-") as logs:
        launcher = Launcher(model, ["--kv-cache-memory-bytes", str(64 << 20)], edge_port=free_port(),
                            log_dir=Path(logs), edge_limits=limits)
        try:
            launcher.start()
            host, port = launcher.edge_address.rsplit(":", 1)
            results = measure(host, int(port), args)
        finally:
            launcher.stop()
    results = {"model": model, "probe_path": args.probe_path, "slow_clients": args.slow_clients,
               "byte_interval_s": args.byte_interval, "phase_s": args.phase_s, "rounds": args.rounds,
               "request_headers_timeout_s": limits.request_headers_timeout_s, **results,
               "p99_within_2x": results["p99_ratio"] <= 2.0}
    print(f"{'phase':<8}{'probes':>8}{'median ms':>12}{'p99 ms':>10}")
    for phase in ("idle", "attack"):
        summary = results[phase]
        print(f"{phase:<8}{summary['n']:>8}{summary['median_ms']:>12.2f}{summary['p99_ms']:>10.2f}")
    slow = results["slow_connections"]
    print(f"probe p99 under slowloris / idle: {results['p99_ratio']:.2f}x (median {results['median_ratio']:.2f}x); "
          f"{slow['held_at_once']} slow connections held, {slow['cut_by_edge']} cut by the edge {slow['cut_how']}, "
          f"after {slow['lifetime_median_s']} s (median)")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results, indent=2) + "\n")
    return 0
