"""``MediaLoader``: images by data: / http: / file: URL, every failure a 400 naming the part,
within the fetch timeout; a local HTTP server stands in for the web."""

from __future__ import annotations

import asyncio
import base64
import io
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image

from gridserve.services.gateway.media_loader import MediaConfig, MediaLoader
from gridserve.shared.errors import InvalidArgumentError

FIELD = "messages[0].content[1]"


def _png(size: tuple[int, int] = (20, 10)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, (200, 10, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path == "/slow.png":
            self.send_response(200)
            self.end_headers()
            for _ in range(40):  # trickles bytes: no single read times out, the whole fetch does
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.1)
            return
        body = {"/cat.png": _png(), "/big.png": b"\0" * 5000, "/junk.png": b"not an image"}.get(self.path)
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def _load(loader: MediaLoader, url: str) -> Image.Image:
    return asyncio.run(loader.load_all([(FIELD, url)]))[0]


def _refused(loader: MediaLoader, url: str, match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match) as err:
        _load(loader, url)
    assert err.value.field == FIELD


def test_data_url_and_http_url_give_the_same_image(server):
    loader = MediaLoader(MediaConfig(allowed_media_domains=("127.0.0.1",)))
    data_url = "data:image/png;base64," + base64.b64encode(_png()).decode()
    assert _load(loader, data_url).tobytes() == _load(loader, f"{server}/cat.png").tobytes()
    assert _load(loader, data_url).size == (20, 10)


def test_bad_images_are_refused_naming_the_part(server):
    loader = MediaLoader(MediaConfig(max_image_bytes=4000))
    _refused(loader, "data:image/png;base64,@@@@", "not valid base64")
    _refused(loader, "data:image/png,abc", "base64")
    _refused(loader, "data:image/png;base64," + base64.b64encode(b"\0" * 5000).decode(), "larger than 4000")
    _refused(loader, "data:image/png;base64," + base64.b64encode(b"hello").decode(), "cannot decode")
    _refused(loader, f"{server}/big.png", "larger than 4000")
    _refused(loader, f"{server}/junk.png", "cannot decode")
    _refused(loader, f"{server}/missing.png", "HTTP 404")
    _refused(loader, "ftp://example.com/a.png", "unsupported image URL scheme")
    _refused(loader, "http://127.0.0.1:1/refused.png", "fetching the image failed")


def test_a_disallowed_domain_is_refused_without_fetching(server):
    loader = MediaLoader(MediaConfig(allowed_media_domains=("images.example.com",)))
    _refused(loader, f"{server}/cat.png", "not allowed")


def test_a_slow_url_times_out_within_the_fetch_timeout(server):
    loader = MediaLoader(MediaConfig(media_fetch_timeout_s=0.5))
    start = time.monotonic()
    _refused(loader, f"{server}/slow.png", "longer than 0.5s")
    assert time.monotonic() - start < 2.0


def test_file_urls_only_under_the_allowed_local_path(tmp_path):
    (tmp_path / "ok.png").write_bytes(_png())
    _refused(MediaLoader(), f"file://{tmp_path}/ok.png", "no --allowed-local-media-path")
    loader = MediaLoader(MediaConfig(allowed_local_media_path=str(tmp_path / "sub")))
    (tmp_path / "sub").mkdir()
    _refused(loader, f"file://{tmp_path}/sub/../ok.png", "outside")
    allowed = MediaLoader(MediaConfig(allowed_local_media_path=str(tmp_path)))
    assert _load(allowed, f"file://{tmp_path}/ok.png").size == (20, 10)
    _refused(allowed, f"file://{tmp_path}/none.png", "cannot read")


def test_thread_count_comes_from_the_environment(monkeypatch):
    from gridserve.services.gateway.media_loader import THREADS_ENV, thread_count_from_env

    monkeypatch.setenv(THREADS_ENV, "3")
    assert thread_count_from_env() == 3
    monkeypatch.setenv(THREADS_ENV, "0")
    with pytest.raises(ValueError, match=THREADS_ENV):
        thread_count_from_env()


def test_media_flags_take_environment_defaults_and_reach_the_gateway_command_line(monkeypatch, tmp_path):
    import argparse

    from gridserve.services.gateway.media_loader import add_media_arguments

    monkeypatch.setenv("GRIDSERVE_ALLOWED_MEDIA_DOMAINS", "a.example, b.example")
    monkeypatch.setenv("GRIDSERVE_ALLOWED_LOCAL_MEDIA_PATH", str(tmp_path))
    parser = argparse.ArgumentParser()
    add_media_arguments(parser)
    config = MediaConfig.from_args(parser.parse_args(["--media-fetch-timeout-s", "2"]))
    assert config.allowed_media_domains == ("a.example", "b.example")
    assert config.allowed_local_media_path == str(tmp_path) and config.media_fetch_timeout_s == 2.0
    monkeypatch.delenv("GRIDSERVE_ALLOWED_MEDIA_DOMAINS")
    monkeypatch.delenv("GRIDSERVE_ALLOWED_LOCAL_MEDIA_PATH")
    parser = argparse.ArgumentParser()
    add_media_arguments(parser)
    assert MediaConfig.from_args(parser.parse_args(config.to_argv())) == config


def test_the_default_image_limit_as_base64_fits_the_edge_body_limit():
    from gridserve.edge import EdgeLimits

    assert MediaConfig().max_image_bytes * 4 / 3 + (64 << 10) < EdgeLimits().max_request_body_bytes
