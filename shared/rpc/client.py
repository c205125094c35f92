"""Client helpers: channels, deadlines, and waiting for a server's health to say SERVING.

The roles talk to each other on ``grpc.aio`` channels (``aio_channel``, made on the event loop that
uses it). ``make_channel`` and the health helpers are blocking, for callers that are not a role:
the launcher, the CLI, benchmarks and tests. With TLS configured (``shared.rpc.tls``) every channel
is mutual TLS with this process's certificate; a role's channels are ``RotatingChannel``s, so calls
made after the certificate files changed go out on a new connection with the new certificate.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gridserve.shared import envs
from gridserve.shared.rpc import tls as tls_config

logger = logging.getLogger(__name__)

# Deadline of ordinary unary calls (seconds); long-running control calls pass their own.
DEFAULT_DEADLINE_S = envs.GRIDSERVE_RPC_DEADLINE_S  # read once, at import
_MAX_MESSAGE = 64 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", _MAX_MESSAGE),
    ("grpc.max_receive_message_length", _MAX_MESSAGE),
    ("grpc.keepalive_time_ms", 2000),
    ("grpc.keepalive_timeout_ms", 5000),
    # gRPC core enforces the ping-ack wait through this one (keepalive_timeout_ms alone is not
    # applied): without it a SIGSTOPped peer holds a stream open for minutes.
    ("grpc.http2.ping_timeout_ms", 5000),
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
    ("grpc.keepalive_timeout_ms", 5000),
    ("grpc.http2.ping_timeout_ms", 5000),
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
    files = tls_config.active()
    if files is not None:
        return RotatingChannel(address, files)
    return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)


class RotatingChannel(grpc.aio.Channel):
    """A mutual-TLS ``grpc.aio`` channel that follows certificate rotation.

    Stubs built on it look the current channel up on every call: when the TLS files changed, the
    next call opens a new channel with the new certificate, while streams already open go on over
    the old one (closed with this one).
    """

    def __init__(self, address: str, files: tls_config.TlsFiles) -> None:
        self.address = address
        self.files = files
        self._stamp = files.stamp()
        self._current = grpc.aio.secure_channel(address, files.channel_credentials(), options=CHANNEL_OPTIONS)
        self._old: list[grpc.aio.Channel] = []

    def current(self) -> grpc.aio.Channel:
        try:
            stamp = self.files.stamp()
            if stamp != self._stamp:
                credentials = self.files.channel_credentials()
                self._old.append(self._current)
                self._current = grpc.aio.secure_channel(self.address, credentials, options=CHANNEL_OPTIONS)
                self._stamp = stamp
                logger.info("TLS: new connections to %s use the new certificate %s", self.address, self.files.cert)
        except (OSError, ValueError) as exc:
            logger.warning("TLS files %s not (yet) usable: %s; keeping the current ones", self.files.cert, exc)
        return self._current

    def unary_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _Bound(self, "unary_unary", method, args, kwargs)

    def unary_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _Bound(self, "unary_stream", method, args, kwargs)

    def stream_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _Bound(self, "stream_unary", method, args, kwargs)

    def stream_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _Bound(self, "stream_stream", method, args, kwargs)

    async def channel_ready(self) -> None:
        await self.current().channel_ready()

    def get_state(self, try_to_connect: bool = False) -> grpc.ChannelConnectivity:
        return self.current().get_state(try_to_connect)

    async def wait_for_state_change(self, last_observed_state: grpc.ChannelConnectivity) -> None:
        await self._current.wait_for_state_change(last_observed_state)

    async def close(self, grace: Optional[float] = None) -> None:
        for channel in (*self._old, self._current):
            await channel.close(grace)
        self._old = []

    async def __aenter__(self) -> RotatingChannel:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


class _Bound:
    """A stub's multicallable, made on the channel current at each call."""

    def __init__(self, channel: RotatingChannel, kind: str, method: str, args: tuple, kwargs: dict) -> None:
        self.channel, self.kind, self.method, self.args, self.kwargs = channel, kind, method, args, kwargs

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        make = getattr(self.channel.current(), self.kind)
        return make(self.method, *self.args, **self.kwargs)(*args, **kwargs)


def make_channel(address: str, tls: Optional[tls_config.TlsFiles] = None) -> grpc.Channel:
    """A blocking channel for tools (launcher, CLI, tests); roles use ``aio_channel``. ``tls``: the
    certificate to present (default: this process's, if any)."""
    files = tls or tls_config.active()
    if files is not None:
        return grpc.secure_channel(address, files.channel_credentials(), options=CHANNEL_OPTIONS)
    return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)


def health_status(channel: grpc.Channel, service: str = "", timeout: float = 2.0) -> str:
    """The server's health status name (``SERVING``, ``NOT_SERVING``, ...), or ``UNREACHABLE``."""
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    except grpc.RpcError:
        return "UNREACHABLE"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def wait_until_serving(address: str, timeout: float, service: str = "",
                       tls: Optional[tls_config.TlsFiles] = None) -> None:
    """Block until ``address`` reports SERVING; raise TimeoutError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    with make_channel(address, tls) as channel:
        status = "UNREACHABLE"
        while time.monotonic() < deadline:
            status = health_status(channel, service)
            if status == "SERVING":
                return
            time.sleep(0.1)
    raise TimeoutError(f"{address} not SERVING after {timeout:.0f} s (last status: {status})")
