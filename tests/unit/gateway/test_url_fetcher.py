"""Image URLs without server-side request forgery (services/gateway/url_fetcher.py): no remote
fetch unless allowed; loopback, private, link-local and mapped addresses refused after DNS; every
redirect hop checked; the connection made to the checked address; one deadline bounding the loader
thread itself (slow body, slow headers, silence, slow DNS); one generic error text.

A local HTTP server on 127.0.0.1 stands in for the web. It is reached only as ``images.test``: a
name no system resolver knows, mapped to 127.0.0.1 by the test's resolver, and the only name the
test's address policy lets through, so the real policy still refuses 127.0.0.1 itself."""

from __future__ import annotations

import io
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image

from gridserve.services.gateway.url_fetcher import UrlFetcher, is_public_address
from gridserve.shared.errors import InvalidArgumentError

FIELD = "messages[0].content[1]"
NAME = "images.test"


def _png() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (20, 10), (200, 10, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


class _Handler(BaseHTTPRequestHandler):
    hits: list[str] = []

    def do_GET(self):  # noqa: N802 - http.server's name
        self.hits.append(self.path)
        port = self.server.server_address[1]
        redirects = {"/to-loopback": f"http://127.0.0.1:{port}/cat.png", "/to-other": "http://evil.test/cat.png",
                     "/hop": "/cat.png", "/loop": "/loop", "/to-metadata": "http://169.254.169.254/latest/"}
        if self.path in redirects:
            self.send_response(302)
            self.send_header("Location", redirects[self.path])
            self.end_headers()
            return
        if self.path == "/slow-body":
            self.send_response(200)
            self.end_headers()
            self._trickle(b"x" * 100)
            return
        if self.path == "/slow-headers":
            self.wfile.write(b"HTTP/1.1 200 OK\r\n")
            self._trickle(b"X-Pad: " + b"a" * 100)
            return
        if self.path == "/silent":
            time.sleep(3)
            return
        body = {"/cat.png": _png(), "/big.png": b"\0" * 5000}.get(self.path)
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _trickle(self, data: bytes) -> None:
        for byte in data:  # no single read waits long: only a deadline on the whole fetch ends it
            try:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
            except OSError:
                return
            time.sleep(0.05)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def port():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield httpd.server_address[1]
    httpd.shutdown()


@pytest.fixture(autouse=True)
def _fresh_hits():
    _Handler.hits.clear()


def _local(allowed=(NAME,), timeout_s: float = 2.0, resolver=None) -> UrlFetcher:
    """The fetcher with ``images.test`` -> 127.0.0.1, the only name allowed past the address check."""
    return UrlFetcher(allowed, timeout_s, 4000, resolver=resolver or (lambda host, port: ["127.0.0.1"]),
                      address_allowed=lambda host, address: host == NAME)


def _refused(fetcher: UrlFetcher, url: str, match: str = "cannot fetch the image URL") -> str:
    with pytest.raises(InvalidArgumentError, match=match) as error:
        fetcher.fetch(FIELD, url)
    assert error.value.field == FIELD
    return str(error.value)


def test_no_remote_fetch_unless_allowed():
    for allowed in (None, ()):
        message = _refused(UrlFetcher(allowed, 1.0, 4000), "http://example.com/a.png", "--allowed-media-domains")
        assert "data: URL" in message
    _refused(UrlFetcher(("images.example.com",), 1.0, 4000), "http://example.com/a.png", "not allowed")


def test_loopback_private_link_local_and_mapped_addresses_are_refused_before_connecting(port):
    fetcher = UrlFetcher(("*",), 1.0, 4000)  # any host: still public addresses only
    for host in ("127.0.0.1", "localhost", "[::1]", "[::ffff:127.0.0.1]", "169.254.169.254", "10.0.0.1",
                 "192.168.1.1", "0.0.0.0", "224.0.0.1"):
        _refused(fetcher, f"http://{host}:{port}/cat.png")
    assert _Handler.hits == []
    mixed = UrlFetcher(("*",), 1.0, 4000, resolver=lambda host, port: ["93.184.216.34", "127.0.0.1"])
    _refused(mixed, "http://images.example/cat.png")  # one private address is enough to refuse


@pytest.mark.parametrize("address, public", [
    ("93.184.216.34", True), ("2606:4700::1", True), ("127.0.0.1", False), ("10.1.2.3", False),
    ("172.16.0.1", False), ("100.64.0.1", False), ("169.254.169.254", False), ("fe80::1", False),
    ("fd00::1", False), ("::1", False), ("::ffff:10.0.0.1", False), ("2002:7f00:1::", False),
    ("64:ff9b::a00:1", False), ("ff02::1", False), ("239.1.1.1", False), ("0.0.0.0", False),
])
def test_public_addresses(address, public):
    assert is_public_address(address) is public


def test_the_connection_goes_to_the_checked_address(port):
    # No system resolver knows images.test: only the checked address can have been dialled.
    assert _local().fetch(FIELD, f"http://{NAME}:{port}/cat.png") == _png()


def test_every_redirect_hop_is_checked(port):
    fetcher = _local()
    assert fetcher.fetch(FIELD, f"http://{NAME}:{port}/hop") == _png()
    assert _Handler.hits == ["/hop", "/cat.png"]
    for path in ("/to-loopback", "/to-other", "/to-metadata", "/loop"):
        _refused(fetcher, f"http://{NAME}:{port}{path}")
    assert _Handler.hits[2:] == ["/to-loopback", "/to-other", "/to-metadata"] + ["/loop"] * 4
    anywhere = UrlFetcher(("*",), 1.0, 4000, resolver=lambda host, port: ["127.0.0.1"],
                          address_allowed=lambda host, address: host == NAME)
    _refused(anywhere, f"http://{NAME}:{port}/to-loopback")


def test_errors_say_nothing_about_the_inside(port):
    fetcher = _local(timeout_s=1.0)
    missing = _refused(fetcher, f"http://{NAME}:{port}/missing.png")
    refused = _refused(fetcher, f"http://{NAME}:1/cat.png")
    loopback = _refused(UrlFetcher(("*",), 1.0, 4000), f"http://127.0.0.1:{port}/cat.png")
    assert missing == refused == loopback and "404" not in missing
    _refused(fetcher, f"http://{NAME}:{port}/big.png", "larger than 4000 bytes")


@pytest.mark.parametrize("path", ["/slow-body", "/slow-headers", "/silent"])
def test_one_deadline_bounds_the_loader_thread_itself(port, path):
    start = time.monotonic()
    _refused(_local(timeout_s=0.4), f"http://{NAME}:{port}{path}")
    assert time.monotonic() - start < 1.0


def test_slow_dns_is_bounded_by_the_deadline():
    def hanging(host, port):
        time.sleep(3)
        return ["127.0.0.1"]

    start = time.monotonic()
    _refused(_local(timeout_s=0.3, resolver=hanging), f"http://{NAME}:80/cat.png")
    assert time.monotonic() - start < 0.8


def test_a_literal_address_needs_no_lookup():
    calls = []
    fetcher = UrlFetcher(("*",), 0.5, 4000, resolver=lambda host, port: calls.append(host) or [])
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        _refused(fetcher, f"http://127.0.0.1:{closed.getsockname()[1]}/")
    assert calls == []
