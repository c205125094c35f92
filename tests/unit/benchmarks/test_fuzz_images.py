"""The fuzzer's image cases (benchmarks/fuzz.py, issue 38), without a deployment: each fixed case is
what its name says to the gateway's real ``MediaLoader`` (a case marked refused is a 400 naming
its part, a valid one loads); the answer check; the local image server's slow body and redirects."""

from __future__ import annotations

import asyncio
import time
import urllib.error
import urllib.request

import pytest

from gridserve.benchmarks.fuzz import MediaServer, image_cases, image_problem, media_problems
from gridserve.services.gateway.media_loader import MediaConfig, MediaLoader
from gridserve.shared.errors import InvalidArgumentError


def _loads(loader: MediaLoader, urls: list[str]) -> bool:
    fields = [(f"messages[0].content[{i}]", url) for i, url in enumerate(urls)]
    try:
        asyncio.run(loader.load_all(fields))
        return True
    except InvalidArgumentError as exc:
        assert exc.field.startswith("messages[0].content["), exc.field
        return False


def test_each_fixed_case_is_what_its_name_says_to_the_real_loader():
    with MediaServer() as media:
        cases = image_cases(media)
        kinds = {kind for kind, _, _ in cases}
        assert {"bomb-8000x8000", "aspect-1x5000", "count-100", "base64-invalid", "url-127.0.0.1", "url-metadata",
                "url-slow", "url-redirect-to-127.0.0.1"} <= kinds
        loader = MediaLoader(MediaConfig(media_fetch_timeout_s=0.5))  # the defaults: no image URL fetched
        try:
            for kind, urls, refused in cases:
                assert _loads(loader, urls) is not refused or kind == "url-local-server", kind
        finally:
            loader.close()
        assert media.hits == []  # a gateway with the defaults never asks the local server


def test_the_answer_check():
    refused = b'{"error": {"message": "m", "type": "BadRequestError", "param": "messages[0].content[0]", "code": 400}}'
    other = b'{"error": {"message": "m", "type": "BadRequestError", "param": "max_tokens", "code": 400}}'
    ok = b'{"choices": []}'
    assert image_problem(takes_images=False, must_refuse=False)(400, refused) is None
    assert "must be refused" in image_problem(takes_images=False, must_refuse=False)(200, ok)
    assert "not naming" in image_problem(takes_images=True, must_refuse=True)(400, other)
    assert image_problem(takes_images=True, must_refuse=False)(200, ok) is None


def test_the_local_server_trickles_and_redirects_and_its_log_tells_a_leak():
    with MediaServer(slow_body_s=0.5) as media:
        with pytest.raises(urllib.error.HTTPError) as redirect:
            urllib.request.build_opener(_NoRedirects).open(media.url("/to-loopback"), timeout=5)
        assert redirect.value.code == 302
        assert redirect.value.headers["Location"] == f"http://127.0.0.1:{media.port}/secret"
        start = time.monotonic()
        with urllib.request.urlopen(media.url("/slow.png"), timeout=5) as response:
            assert response.read() == b"x" * 5
        assert time.monotonic() - start >= 0.4
        assert media_problems(media, fetches_from_it=True) == []
        assert media_problems(media, fetches_from_it=False)  # any request at all is a leak there
        urllib.request.urlopen(f"http://127.0.0.1:{media.port}/secret", timeout=5).close()
        assert "redirect to 127.0.0.1" in media_problems(media, fetches_from_it=True)[0]


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None
