"""Client helpers: channels, deadlines, and waiting for a server's health to say SERVING.

The roles talk to each other on ``grpc.aio`` channels (``aio_channel``, made on the event loop that
uses it). ``make_channel`` and the health helpers are blocking, for callers that are not a role:
the launcher, the CLI, benchmarks and tests.
"""

from __future__ import annotations

import logging
import os
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

logger = logging.getLogger(__name__)

# Deadline of ordinary unary calls (seconds); long-running control calls pass their own.
DEFAULT_DEADLINE_S = float(os.environ.get("GRIDSERVE_RPC_DEADLINE_S", "30"))
_MAX_MESSAGE = 64 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", _MAX_MESSAGE),
    ("grpc.max_receive_message_length", _MAX_MESSAGE),
    ("grpc.keepalive_time_ms", 2000),
    ("grpc.keepalive_timeout_ms", 2000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
# Servers accept the clients' keepalive pings (a dead peer is noticed within seconds).
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", _MAX_MESSAGE),
    ("grpc.max_receive_message_length", _MAX_MESSAGE),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 1000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.keepalive_time_ms", 2000),
    ("grpc.keepalive_timeout_ms", 2000),
]


def parse_addresses(value: str, what: str) -> list[str]:
    """Split ``host:port,host:port``; raise ValueError naming ``what`` when empty or malformed."""
    addresses = [a.strip() for a in (value or "").split(",") if a.strip()]
    if not addresses:
        raise ValueError(f"no {what} address given")
    for address in addresses:
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"bad {what} address {address!r}: expected host:port")
    return addresses


def aio_channel(address: str) -> grpc.aio.Channel:
    """A role's channel to another role; create it on the event loop that will use it."""
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)


def make_channel(address: str) -> grpc.Channel:
    """A blocking channel for tools (launcher, CLI, tests); roles use ``aio_channel``."""
    return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)


def health_status(channel: grpc.Channel, service: str = "", timeout: float = 2.0) -> str:
    """The server's health status name (``SERVING``, ``NOT_SERVING``, ...), or ``UNREACHABLE``."""
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    except grpc.RpcError:
        return "UNREACHABLE"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def wait_until_serving(address: str, timeout: float, service: str = "") -> None:
    """Block until ``address`` reports SERVING; raise TimeoutError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    with make_channel(address) as channel:
        status = "UNREACHABLE"
        while time.monotonic() < deadline:
            status = health_status(channel, service)
            if status == "SERVING":
                return
            time.sleep(0.1)
    raise TimeoutError(f"{address} not SERVING after {timeout:.0f} s (last status: {status})")
