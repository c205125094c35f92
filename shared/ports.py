"""Free TCP ports for roles started a moment later (the launcher's roles, the workers' rendezvous)."""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports (Linux; a common default elsewhere)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


_handed_out: set[int] = set()  # ports free_port() gave this process: never given twice
_handed_lock = threading.Lock()


def free_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` that a role can bind a moment later.

    Picked at random below the kernel's ephemeral range: a port the kernel picks for ``bind(0)`` lies in
    that range, where any outgoing connection (a gRPC channel, a health probe) may take it as its local
    port before the role binds it, and the role then fails at start with "address in use". Outside
    that range only another explicit bind can take it. Falls back to ``bind(0)`` when no port there is
    free after a few hundred tries.
    """
    low, _ = _ephemeral_range()
    first = 10000 if low > 12000 else 1024
    rng = random.SystemRandom()
    with _handed_lock:
        for _ in range(300):
            port = rng.randrange(first, low)
            if port in _handed_out:
                continue
            with socket.socket() as sock:
                try:
                    sock.bind((host, port))
                except OSError:
                    continue
            _handed_out.add(port)
            return port
        with socket.socket() as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        _handed_out.add(port)
        return port
