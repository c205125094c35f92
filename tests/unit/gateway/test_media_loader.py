"""``MediaLoader``: images by data: / http: / file: URL, every failure a 400 naming the part; an
image costs what its bytes say (pixels and aspect ratio read from the header before decoding, a
per-request count and decoded-byte budget, images loaded one at a time); a slow URL frees its
thread at the deadline. A local HTTP server reached as ``images.test`` stands in for the web (see
test_url_fetcher.py for the address rules)."""

from __future__ import annotations

import asyncio
import base64
import io
import struct
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image

from gridserve.services.gateway.media_loader import MediaConfig, MediaLoader, decode_image
from gridserve.shared.errors import ConfigError, InvalidArgumentError

FIELD = "messages[0].content[1]"
NAME = "images.test"


def _png(size: tuple[int, int] = (20, 10), mode: str = "RGB") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size).save(buffer, format="PNG")
    return buffer.getvalue()


def _data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def _bomb_png(width: int, height: int) -> bytes:
    """A valid grayscale PNG of ``width`` x ``height`` zero pixels: tiny, compressed."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = zlib.compress(b"\0" * ((width + 1) * height), 9)
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", rows) + chunk(b"IEND", b"")


class _Handler(BaseHTTPRequestHandler):
    hits: list[str] = []

    def do_GET(self):  # noqa: N802 - http.server's name
        self.hits.append(self.path)
        if self.path == "/slow.png":
            self.send_response(200)
            self.end_headers()
            for _ in range(40):  # trickles bytes: no single read times out, the whole fetch does
                try:
                    self.wfile.write(b"x")
                    self.wfile.flush()
                except OSError:
                    return
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
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield f"http://{NAME}:{httpd.server_address[1]}"
    httpd.shutdown()


def _loader(**config) -> MediaLoader:
    """A loader allowed to fetch from ``images.test`` (the local server) and nowhere else."""
    config.setdefault("allowed_media_domains", (NAME,))
    return MediaLoader(MediaConfig(**config), resolver=lambda host, port: ["127.0.0.1"],
                       address_allowed=lambda host, address: host == NAME)


def _load(loader: MediaLoader, url: str) -> Image.Image:
    return asyncio.run(loader.load_all([(FIELD, url)]))[0]


def _refused(loader: MediaLoader, url: str, match: str) -> None:
    with pytest.raises(InvalidArgumentError, match=match) as err:
        _load(loader, url)
    assert err.value.field == FIELD


def test_data_url_and_http_url_give_the_same_image(server):
    loader = _loader()
    assert _load(loader, _data_url(_png())).tobytes() == _load(loader, f"{server}/cat.png").tobytes()
    assert _load(loader, _data_url(_png())).size == (20, 10)


def test_by_default_no_url_is_fetched_and_data_urls_still_work(server):
    loader = MediaLoader()
    _refused(loader, f"{server}/cat.png", "--allowed-media-domains")
    _refused(MediaLoader(MediaConfig(allowed_media_domains=("*",))), "http://127.0.0.1:1/a.png", "cannot fetch")
    assert _load(loader, _data_url(_png())).size == (20, 10)


def test_bad_images_are_refused_naming_the_part(server):
    loader = _loader(max_image_bytes=4000)
    _refused(loader, "data:image/png;base64,@@@@", "not valid base64")
    _refused(loader, "data:image/png,abc", "base64")
    _refused(loader, _data_url(b"\0" * 5000), "larger than 4000")
    _refused(loader, _data_url(b"hello"), "cannot decode")
    _refused(loader, f"{server}/big.png", "larger than 4000")
    _refused(loader, f"{server}/junk.png", "cannot decode")
    _refused(loader, f"{server}/missing.png", "cannot fetch the image URL")
    _refused(loader, "ftp://example.com/a.png", "unsupported image URL scheme")
    _refused(loader, f"http://{NAME}:1/refused.png", "cannot fetch the image URL")
    _refused(loader, _data_url(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n"), "cannot decode")


def test_a_disallowed_domain_is_refused_without_fetching(server):
    _Handler.hits.clear()
    _refused(_loader(allowed_media_domains=("images.example.com",)), f"{server}/cat.png", "not allowed")
    assert _Handler.hits == []


def test_a_slow_url_frees_its_thread_at_the_deadline_so_eight_of_them_stall_nothing(server):
    loader = _loader(media_fetch_timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(InvalidArgumentError, match="cannot fetch"):
        loader.load(FIELD, f"{server}/slow.png")  # in this thread: the thread itself is bounded
    assert time.monotonic() - start < 1.0

    async def eight_slow_then_one_inline() -> float:
        slow = [asyncio.ensure_future(loader.load_all([(FIELD, f"{server}/slow.png")])) for _ in range(8)]
        await asyncio.sleep(0.05)
        begin = time.monotonic()
        await loader.load_all([(FIELD, _data_url(_png()))])
        waited = time.monotonic() - begin
        await asyncio.gather(*slow, return_exceptions=True)
        return waited

    assert asyncio.run(eight_slow_then_one_inline()) < 1.0


def test_a_decompression_bomb_is_refused_from_its_header():
    bomb = _bomb_png(8000, 8000)  # 64 M pixels in about 64 kB
    assert len(bomb) < 100_000
    start = time.monotonic()
    with pytest.raises(InvalidArgumentError, match="--max-image-pixels") as err:
        decode_image(FIELD, bomb)
    assert err.value.field == FIELD and time.monotonic() - start < 0.5
    assert decode_image(FIELD, _bomb_png(300, 200)).size == (300, 200)


def test_an_extreme_aspect_ratio_is_refused():
    _refused(_loader(), _data_url(_png((1, 5000))), "--max-image-aspect-ratio")
    _refused(_loader(), _data_url(_png((5000, 2))), "aspect ratio")
    assert _load(_loader(), _data_url(_png((500, 20)))).size == (500, 20)


def test_images_per_request_are_capped_before_any_is_loaded(server):
    _Handler.hits.clear()
    urls = [(f"messages[0].content[{i}]", f"{server}/cat.png") for i in range(100)]
    with pytest.raises(InvalidArgumentError, match="100 images in one request, at most 8") as err:
        asyncio.run(_loader().load_all(urls))
    assert err.value.field == "messages[0].content[8]" and _Handler.hits == []
    four = _loader(limit_mm_per_prompt=(("image", 4),))
    with pytest.raises(InvalidArgumentError, match="--limit-mm-per-prompt"):
        asyncio.run(four.load_all(urls[:5]))
    assert len(asyncio.run(four.load_all([(f, _data_url(_png())) for f, _ in urls[:4]]))) == 4


def test_a_request_s_images_share_one_decoded_byte_budget():
    loader = _loader(max_request_image_bytes=6_000_000)  # one 1000 x 1000 image takes 4 MB decoded
    urls = [(f"messages[0].content[{i}]", _data_url(_png((1000, 1000), "L"))) for i in range(2)]
    with pytest.raises(InvalidArgumentError, match="--max-request-image-bytes") as err:
        asyncio.run(loader.load_all(urls))
    assert err.value.field == "messages[0].content[1]"
    assert len(asyncio.run(loader.load_all(urls[:1]))) == 1


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


def _parse(argv: list[str]) -> MediaConfig:
    import argparse

    from gridserve.services.gateway.media_loader import add_media_arguments

    parser = argparse.ArgumentParser()
    add_media_arguments(parser)
    return MediaConfig.from_args(parser.parse_args(argv))


def test_media_flags_take_environment_defaults_and_reach_the_gateway_command_line(monkeypatch, tmp_path):
    monkeypatch.setenv("GRIDSERVE_ALLOWED_MEDIA_DOMAINS", "a.example, b.example")
    monkeypatch.setenv("GRIDSERVE_ALLOWED_LOCAL_MEDIA_PATH", str(tmp_path))
    monkeypatch.setenv("GRIDSERVE_LIMIT_MM_PER_PROMPT", '{"image": 3}')
    config = _parse(["--media-fetch-timeout-s", "2", "--max-image-pixels", "1000000",
                     "--max-image-aspect-ratio", "10", "--max-request-image-bytes", "9000000"])
    assert config.allowed_media_domains == ("a.example", "b.example") and config.max_images == 3
    assert config.allowed_local_media_path == str(tmp_path) and config.media_fetch_timeout_s == 2.0
    assert (config.max_image_pixels, config.max_image_aspect_ratio, config.max_request_image_bytes) == (
        1_000_000, 10.0, 9_000_000)
    for name in ("GRIDSERVE_ALLOWED_MEDIA_DOMAINS", "GRIDSERVE_ALLOWED_LOCAL_MEDIA_PATH", "GRIDSERVE_LIMIT_MM_PER_PROMPT"):
        monkeypatch.delenv(name)
    assert _parse(config.to_argv()) == config
    assert _parse([]) == MediaConfig() and MediaConfig().allowed_media_domains is None


@pytest.mark.parametrize("text, match", [
    ("image=4", "JSON"), ("[4]", "JSON object"), ('{"images": 4}', "unknown modality"),
    ('{"image": -1}', "integer >= 0"), ('{"image": true}', "integer >= 0"),
])
def test_limit_mm_per_prompt_is_vllm_json_and_bad_values_name_the_flag(text, match):
    with pytest.raises(ConfigError, match=match) as err:
        _parse(["--limit-mm-per-prompt", text])
    assert err.value.field == "limit-mm-per-prompt"
    assert _parse(["--limit-mm-per-prompt", '{"image": 0, "video": 1}']).max_images == 0


def test_the_default_image_limit_as_base64_fits_the_edge_body_limit():
    from gridserve.edge import EdgeLimits

    assert MediaConfig().max_image_bytes * 4 / 3 + (64 << 10) < EdgeLimits().max_request_body_bytes
