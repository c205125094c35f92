"""Safe by default through a real ``gridserve serve``-like deployment (issue 38), one Llava
deployment started as ``serve --host 0.0.0.0 --api-key KEY --allowed-media-domains '*'``:

- only the edge listens beyond loopback: every other role (and its metrics) is on 127.0.0.1, and
  the engine's port is closed on the machine's own address;
- the web console's answers carry its security headers (CSP with frame-ancestors 'none', nosniff);
- ``/tokenize`` stays open for text but its image path needs the key, as generation's does;
- hostile images through the edge are 400 naming the part, at once: a decompression bomb, an
  extreme aspect ratio, 100 images, URLs at loopback / link-local / private addresses (never
  fetched, one generic message); the deployment answers a normal request afterwards.
"""

from __future__ import annotations

import base64
import io
import json
import socket
import struct
import threading
import time
import urllib.error
import urllib.request
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
from PIL import Image

from gridserve.launcher import free_port

from .services import deployment

pytestmark = pytest.mark.slow

KEY = "s3cret"
TIMEOUT_S = 15


def _png(height: int = 40, width: int = 52) -> bytes:
    pixels = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def _bomb() -> bytes:
    """A valid 8000 x 8000 grayscale PNG of zeros in about 64 kB."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = zlib.compress(b"\0" * 8001 * 8000, 9)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 8000, 8000, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", rows) + chunk(b"IEND", b""))


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _outside_address() -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("192.0.2.1", 9))
            address = sock.getsockname()[0]
        except OSError:
            address = ""
    if not address or address.startswith("127."):
        pytest.skip("this machine has no non-loopback IPv4 address")
    return address


class _Images(BaseHTTPRequestHandler):
    hits: list[str] = []

    def do_GET(self):  # noqa: N802 - http.server's name
        self.hits.append(self.path)
        body = _png()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def images():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield httpd.server_address[1]
    httpd.shutdown()


@pytest.fixture(scope="module")
def served(llava_tiny, tmp_path_factory):
    engine_args = ["--kv-cache-memory-bytes", str(16 << 20), "--max-num-seqs", "16"]
    with deployment(llava_tiny, tmp_path_factory.mktemp("logs"), edge_port=free_port(), engine_args=engine_args,
                    host="0.0.0.0", api_key=KEY,
                    gateway_args=["--allowed-media-domains", "*", "--media-fetch-timeout-s", "2"]) as launcher:
        yield launcher


def _edge_url(served, path: str) -> str:
    return f"http://127.0.0.1:{served.edge_address.rpartition(':')[2]}{path}"


def _post(served, path: str, body: dict, key: bool = True) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {KEY}"} if key else {})}
    request = urllib.request.Request(_edge_url(served, path), data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _chat_body(*urls: str) -> dict:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "What is this?"}]}],
            "max_tokens": 4, "temperature": 0.0}


def test_only_the_edge_listens_beyond_loopback(served):
    outside = _outside_address()
    for proc in served.processes:
        if proc.role == "edge":
            assert proc.address.startswith("0.0.0.0:")
            continue
        assert proc.address.startswith("127.0.0.1:"), proc
        assert proc.metrics_address is None or proc.metrics_address.startswith("127.0.0.1:"), proc
    engine_port = int(next(p for p in served.processes if p.role == "engine").address.rpartition(":")[2])
    with pytest.raises(ConnectionRefusedError), socket.create_connection((outside, engine_port), timeout=5):
        pass
    edge_port = served.edge_address.rpartition(":")[2]
    with urllib.request.urlopen(f"http://{outside}:{edge_port}/health", timeout=TIMEOUT_S) as response:
        assert response.status == 200


def test_the_console_carries_its_security_headers(served):
    for path in ("/", "/console/chat.js"):
        with urllib.request.urlopen(_edge_url(served, path), timeout=TIMEOUT_S) as response:
            headers = response.headers
            assert response.status == 200
        policy = headers["content-security-policy"] or ""
        assert "frame-ancestors 'none'" in policy and "script-src 'self'" in policy, policy
        assert headers["x-content-type-options"] == "nosniff" and headers["x-frame-options"] == "DENY"


def test_tokenize_with_images_needs_the_key_and_text_does_not(served):
    image = _chat_body(_data_url(_png()))
    status, body = _post(served, "/tokenize", {"messages": image["messages"]}, key=False)
    assert status == 401 and body["error"]["type"] == "AuthenticationError", body
    status, with_key = _post(served, "/tokenize", {"messages": image["messages"]})
    assert status == 200 and with_key["count"] > 25
    status, text = _post(served, "/tokenize", {"prompt": "hello"}, key=False)
    assert status == 200 and text["count"] > 0


def _refused(served, body: dict, part: str, match: str) -> None:
    start = time.monotonic()
    status, answer = _post(served, "/v1/chat/completions", body)
    assert status == 400, answer
    assert answer["error"]["param"] == part and match in answer["error"]["message"], answer
    assert time.monotonic() - start < 5


def test_hostile_images_are_400_naming_the_part_and_the_deployment_serves_on(served, images):
    _Images.hits.clear()
    _refused(served, _chat_body(_data_url(_bomb())), "messages[0].content[0]", "--max-image-pixels")
    _refused(served, _chat_body(_data_url(_png(5000, 1))), "messages[0].content[0]", "aspect ratio")
    hundred = _chat_body(*[_data_url(_png())] * 100)
    _refused(served, hundred, "messages[0].content[8]", "--limit-mm-per-prompt")
    generic = set()
    for url in (f"http://127.0.0.1:{images}/a.png", f"http://localhost:{images}/a.png",
                f"http://[::ffff:127.0.0.1]:{images}/a.png", "http://169.254.169.254/latest/meta-data/",
                "http://10.0.0.1/a.png"):
        status, answer = _post(served, "/v1/chat/completions", _chat_body(url))
        assert status == 400 and answer["error"]["param"] == "messages[0].content[0]", answer
        generic.add(answer["error"]["message"])
    assert len(generic) == 1 and "cannot fetch the image URL" in generic.pop()
    assert _Images.hits == []  # no loopback address was ever connected to
    status, answer = _post(served, "/v1/chat/completions", _chat_body(_data_url(_png())))
    assert status == 200 and answer["choices"][0]["message"]["content"] is not None
