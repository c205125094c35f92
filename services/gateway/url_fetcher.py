"""``UrlFetcher``: image URLs fetched without server-side request forgery, within one deadline.

A request's image URL makes the gateway connect somewhere on its behalf, from inside the
deployment's network; so:

- **Which hosts.** Only those the operator listed in ``--allowed-media-domains`` (the URL's host
  name, exactly); empty, the default, means no remote fetch at all (``data:`` URLs still work);
  ``*`` means any host, still only at public addresses.
- **Which addresses.** The name is resolved in a small pool of its own, within the fetch's
  deadline; every address it resolves to must be public: not private, loopback, link-local (the
  cloud metadata service at 169.254.169.254), multicast, reserved, shared or unspecified, nor an
  IPv4-mapped, 6to4, Teredo or NAT64 form of one. The connection then goes to the address that was
  checked (not to the name again, so DNS rebinding cannot swap it); HTTPS still verifies the
  certificate against the name.
- **Redirects** are followed by hand, at most ``MAX_REDIRECTS``, each hop checked as the first
  (scheme, host, addresses).
- **Time.** One deadline for the whole fetch (DNS, connect, TLS, headers, body): a watchdog shuts
  the socket when it passes, so a server that trickles its headers or body a byte at a time, or says
  nothing, holds the loader thread no longer than the deadline; a resolver that hangs is left
  behind in its pool.
- **Errors.** Past the allowlist every failure is one generic message: what the internal network
  looks like (a private address refused, a status, a DNS error, a timeout) never reaches the
  client; the log has the reason. A body over ``max_bytes`` is refused as such.

``resolver`` and ``address_allowed`` are injectable, for tests that serve images on loopback.
"""

from __future__ import annotations

import http.client
import ipaddress
import logging
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

from gridserve.shared.errors import InvalidArgumentError

logger = logging.getLogger(__name__)

MAX_REDIRECTS = 3
DNS_THREADS = 4
ANY_HOST = "*"
_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
_CHUNK = 64 << 10
_NAT64 = ipaddress.ip_network("64:ff9b::/96")

Resolver = Callable[[str, int], list[str]]
AddressPolicy = Callable[[str, str], bool]  # (host name, address) -> may the fetcher connect there


class FetchRefused(Exception):
    """A fetch that must not or could not happen; the reason is logged, never shown to the client."""


class BodyTooLarge(Exception):
    """The response is larger than the byte limit."""


def system_resolver(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to (the system resolver)."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def is_public_address(text: str) -> bool:
    """Whether an address is globally routable unicast (the address an embedding form hides, too)."""
    address = ipaddress.ip_address(text.split("%", 1)[0])
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        elif address.sixtofour is not None:
            address = address.sixtofour
        elif address.teredo is not None:
            address = address.teredo[1]
        elif address in _NAT64:
            address = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return address.is_global and not address.is_multicast


def public_only(_host: str, address: str) -> bool:
    return is_public_address(address)


class UrlFetcher:
    """Fetches ``http(s)`` URLs under the rules above; ``fetch`` blocks (run it in a loader thread)."""

    def __init__(self, allowed_domains: Optional[tuple[str, ...]], timeout_s: float, max_bytes: int, *,
                 resolver: Resolver = system_resolver, address_allowed: AddressPolicy = public_only,
                 max_redirects: int = MAX_REDIRECTS) -> None:
        self.allowed = frozenset(d.strip().lower() for d in allowed_domains or () if d.strip())
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self.resolver = resolver
        self.address_allowed = address_allowed
        self.max_redirects = max_redirects
        self.dns_pool = ThreadPoolExecutor(DNS_THREADS, thread_name_prefix="media-dns")
        self.tls = ssl.create_default_context()
        self.generic_error = (f"cannot fetch the image URL (images are fetched only from public addresses of "
                              f"allowed hosts, with at most {max_redirects} redirects, within {timeout_s:g}s)")

    def fetch(self, field: str, url: str) -> bytes:
        """The body of ``url``: an ``InvalidArgumentError`` on ``field`` for every refusal."""
        self._check_first(field, url)
        deadline = time.monotonic() + self.timeout_s
        current = url
        try:
            for _ in range(self.max_redirects + 1):
                body, location = self._get(current, deadline)
                if location is None:
                    return body
                current = urllib.parse.urljoin(current, location)
            raise FetchRefused(f"more than {self.max_redirects} redirects")
        except BodyTooLarge:
            raise InvalidArgumentError(field, f"the image is larger than {self.max_bytes} bytes "
                                       "(--max-image-bytes)") from None
        except (FetchRefused, OSError, http.client.HTTPException, ValueError) as exc:
            logger.info("image URL %s (at %s) not fetched: %s: %s", url, current, type(exc).__name__, exc)
            raise InvalidArgumentError(field, self.generic_error) from None

    def close(self) -> None:
        self.dns_pool.shutdown(wait=False, cancel_futures=True)

    # ---- the checks ---------------------------------------------------------------------------
    def _check_first(self, field: str, url: str) -> None:
        """What needs no network, with explicit messages: remote fetch on, the host allowed."""
        if not self.allowed:
            raise InvalidArgumentError(field, "this server fetches no image URLs (--allowed-media-domains is "
                                       "empty): send the image inline as a data: URL")
        host = (urllib.parse.urlsplit(url).hostname or "").lower()
        if not self._host_allowed(host):
            raise InvalidArgumentError(field, f"the domain {host!r} is not allowed (--allowed-media-domains)")

    def _host_allowed(self, host: str) -> bool:
        return bool(host) and (ANY_HOST in self.allowed or host in self.allowed)

    def _address(self, host: str, port: int, deadline: float) -> str:
        """The checked address to connect to: every address ``host`` resolves to must be allowed."""
        try:
            ipaddress.ip_address(host)
            addresses = [host]  # a literal address: nothing to resolve
        except ValueError:
            lookup = self.dns_pool.submit(self.resolver, host, port)
            addresses = lookup.result(timeout=max(deadline - time.monotonic(), 0.0))
        if not addresses:
            raise FetchRefused(f"{host} resolves to no address")
        refused = [a for a in addresses if not self.address_allowed(host, a)]
        if refused:
            raise FetchRefused(f"{host} resolves to {refused[0]}, which is not a public address")
        return addresses[0]

    # ---- one hop ------------------------------------------------------------------------------
    def _get(self, url: str, deadline: float) -> tuple[bytes, Optional[str]]:
        """``(body, None)``, or ``(b"", location)`` for a redirect; the hop checked first."""
        parts = urllib.parse.urlsplit(url)
        scheme, host = parts.scheme.lower(), (parts.hostname or "").lower()
        if scheme not in ("http", "https"):
            raise FetchRefused(f"scheme {scheme!r}")
        if not self._host_allowed(host):
            raise FetchRefused(f"host {host!r} is not allowed")
        port = parts.port or (443 if scheme == "https" else 80)
        address = self._address(host, port, deadline)
        connection = _PinnedConnection(host, port, address, self.tls if scheme == "https" else None,
                                       timeout=_remaining(deadline))
        with _Watchdog(connection, deadline) as watchdog:
            try:
                path = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
                connection.request("GET", path, headers={"Accept": "image/*", "Accept-Encoding": "identity",
                                                         "User-Agent": "gridserve-media-loader"})
                response = connection.getresponse()
                if response.status in _REDIRECT_STATUSES:
                    location = response.getheader("Location")
                    if not location:
                        raise FetchRefused(f"HTTP {response.status} without a Location")
                    return b"", location
                if response.status != 200:
                    raise FetchRefused(f"HTTP {response.status}")
                return self._body(response, watchdog), None
            except OSError:
                if watchdog.fired:
                    raise TimeoutError("past the deadline") from None
                raise
            finally:
                connection.close()

    def _body(self, response: http.client.HTTPResponse, watchdog: _Watchdog) -> bytes:
        length = response.getheader("Content-Length")
        if length and length.isdigit() and int(length) > self.max_bytes:
            raise BodyTooLarge
        data = bytearray()
        while chunk := response.read1(_CHUNK):
            data += chunk
            if len(data) > self.max_bytes:
                raise BodyTooLarge
        if watchdog.fired:  # the socket was shut at the deadline: what came is not the whole body
            raise TimeoutError("past the deadline")
        return bytes(data)


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("past the deadline")
    return left


class _PinnedConnection(http.client.HTTPConnection):
    """HTTP(S) to ``host`` at the checked ``address``: the name goes in the Host header and the TLS
    server name (the certificate is verified against it); no second lookup."""

    def __init__(self, host: str, port: int, address: str, tls: Optional[ssl.SSLContext], timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self.address = address
        self.tls = tls
        # The socket, kept: http.client hands it to the response and forgets it (``sock = None``).
        self.live: Optional[socket.socket] = None

    def connect(self) -> None:
        self.sock = self.live = socket.create_connection((self.address, self.port), self.timeout)
        if self.tls is not None:
            # The handshake runs on the kept socket, so the watchdog can shut it too.
            self.sock = self.live = self.tls.wrap_socket(self.sock, server_hostname=self.host,
                                                         do_handshake_on_connect=False)
            self.sock.do_handshake()

    def shut(self) -> None:
        """Shut the socket from another thread: every read or write on it returns at once."""
        sock = self.live
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class _Watchdog:
    """Shuts ``connection``'s socket at ``deadline`` (a timer thread); ``fired`` says it did."""

    def __init__(self, connection: _PinnedConnection, deadline: float) -> None:
        self.connection = connection
        self.fired = False
        self.timer = threading.Timer(max(deadline - time.monotonic(), 0.0), self._fire)
        self.timer.daemon = True

    def _fire(self) -> None:
        self.fired = True
        self.connection.shut()

    def __enter__(self) -> _Watchdog:
        self.timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.timer.cancel()
