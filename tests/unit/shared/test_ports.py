"""free_port: ports outside the kernel's ephemeral range (where an outgoing connection could take a
port between the pick and the role's bind), never handed out twice, bindable."""

from __future__ import annotations

import itertools
import socket

from gridserve.shared import ports
from gridserve.shared.ports import free_port


def test_ports_lie_below_the_ephemeral_range_and_are_never_repeated():
    low, _ = ports._ephemeral_range()
    picked = [free_port() for _ in range(200)]
    assert len(set(picked)) == len(picked)
    assert all(port < low for port in picked), [p for p in picked if p >= low]
    with socket.socket() as sock:  # a picked port is free to bind
        sock.bind(("127.0.0.1", picked[-1]))


def test_a_port_in_use_is_never_picked(monkeypatch):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        # make the random pick land on the taken port first, then on a free one
        choices = itertools.chain([taken, taken], range(20000, 30000))
        low, _ = ports._ephemeral_range()
        monkeypatch.setattr(ports, "_ephemeral_range", lambda: (max(low, taken + 2), 65535))

        class Fixed:
            def randrange(self, a, b):
                return next(choices)

        monkeypatch.setattr(ports.random, "SystemRandom", Fixed)
        port = free_port()
        assert port != taken
