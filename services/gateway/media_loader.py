"""``MediaLoader``: the images of a chat request, fetched and decoded by a bounded pool of threads.

As vLLM's API server does: ``data:`` URLs (base64) are decoded in place; ``http(s)`` URLs are
fetched by ``thread_count`` loader threads (``GRIDSERVE_MEDIA_LOADING_THREAD_COUNT``, default 8),
each fetch bounded by ``timeout_s`` (the whole fetch, not per read) and ``max_bytes``, and only from
``allowed_domains`` when that is set (``--allowed-media-domains``); ``file:`` URLs only under
``allowed_local_path`` (``--allowed-local-media-path``). Images are decoded with Pillow in the same
threads. Every failure is an ``InvalidArgumentError`` naming the content part (HTTP 400), within
the timeout: a slow server never holds the request longer.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import io
import logging
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from gridserve.shared import envs
from gridserve.shared.errors import InvalidArgumentError

if TYPE_CHECKING:
    from PIL import Image

logger = logging.getLogger(__name__)

THREADS_ENV = "GRIDSERVE_MEDIA_LOADING_THREAD_COUNT"
_CHUNK = 64 << 10


@dataclass(frozen=True)
class MediaConfig:
    """Where images may come from and how big and slow they may be (``gridserve gateway`` flags)."""

    max_image_bytes: int = 20 << 20  # a data: URL of this size (base64: 4/3) fits the edge's 32 MiB body
    media_fetch_timeout_s: float = 5.0
    allowed_media_domains: Optional[tuple[str, ...]] = None  # None: any host
    allowed_local_media_path: Optional[str] = None  # None: no file: URLs
    thread_count: int = 8

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> MediaConfig:
        domains = getattr(args, "allowed_media_domains", None)
        return cls(max_image_bytes=args.max_image_bytes, media_fetch_timeout_s=args.media_fetch_timeout_s,
                   allowed_media_domains=tuple(domains) if domains else None,
                   allowed_local_media_path=args.allowed_local_media_path, thread_count=thread_count_from_env())

    def to_argv(self) -> list[str]:
        argv = []
        if self.max_image_bytes != MediaConfig.max_image_bytes:
            argv += ["--max-image-bytes", str(self.max_image_bytes)]
        if self.media_fetch_timeout_s != MediaConfig.media_fetch_timeout_s:
            argv += ["--media-fetch-timeout-s", str(self.media_fetch_timeout_s)]
        if self.allowed_media_domains:
            argv += ["--allowed-media-domains", *self.allowed_media_domains]
        if self.allowed_local_media_path:
            argv += ["--allowed-local-media-path", self.allowed_local_media_path]
        return argv


def add_media_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("media (images in chat requests)")
    group.add_argument("--max-image-bytes", type=int, default=MediaConfig.max_image_bytes,
                       help=f"largest image, encoded, in bytes (default {MediaConfig.max_image_bytes})")
    group.add_argument("--media-fetch-timeout-s", type=float, default=MediaConfig.media_fetch_timeout_s,
                       help="seconds one image URL may take to fetch (default %(default)s)")
    envs.add_option(group, "--allowed-media-domains", nargs="+", metavar="HOST",
                    help="hosts image URLs may name (default: any; the variable: comma or space separated)")
    envs.add_option(group, "--allowed-local-media-path", metavar="DIR",
                    help="folder file: image URLs may read from (default: none)")


def thread_count_from_env() -> int:
    return envs.GRIDSERVE_MEDIA_LOADING_THREAD_COUNT


class MediaLoader:
    """Loads images by URL in its own bounded thread pool."""

    def __init__(self, config: Optional[MediaConfig] = None) -> None:
        self.config = config or MediaConfig()
        self.pool = ThreadPoolExecutor(max_workers=self.config.thread_count, thread_name_prefix="media-loader")
        self.local_root = (Path(self.config.allowed_local_media_path).resolve()
                           if self.config.allowed_local_media_path else None)

    async def load_all(self, urls: list[tuple[str, str]]) -> list[Image.Image]:
        """``(field, url)`` pairs -> decoded images, in order; all fetched concurrently."""
        loop = asyncio.get_running_loop()
        timeout = self.config.media_fetch_timeout_s
        futures = [asyncio.wait_for(loop.run_in_executor(self.pool, self.load, field, url), timeout + 1.0)
                   for field, url in urls]
        results = await asyncio.gather(*futures, return_exceptions=True)
        for (field, _), result in zip(urls, results):
            if isinstance(result, asyncio.TimeoutError):
                raise InvalidArgumentError(field, f"the image took longer than {timeout}s to load")
            if isinstance(result, BaseException):
                raise result
        return results

    def load(self, field: str, url: str) -> Image.Image:
        """One image, fetched and decoded (blocking: runs in the pool)."""
        return decode_image(field, self.fetch(field, url))

    def fetch(self, field: str, url: str) -> bytes:
        scheme = urllib.parse.urlsplit(url).scheme.lower()
        if scheme == "data":
            return self._data_url(field, url)
        if scheme in ("http", "https"):
            return self._http(field, url)
        if scheme == "file":
            return self._file(field, url)
        raise InvalidArgumentError(field, f"unsupported image URL scheme {scheme!r} (data:, http(s): or file:)")

    def _data_url(self, field: str, url: str) -> bytes:
        header, sep, payload = url[5:].partition(",")
        if not sep or not header.endswith(";base64"):
            raise InvalidArgumentError(field, "a data: URL must be data:<type>;base64,<data>")
        if len(payload) * 3 // 4 > self.config.max_image_bytes:
            raise self._too_big(field)
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise InvalidArgumentError(field, "the data: URL is not valid base64") from None

    def _http(self, field: str, url: str) -> bytes:
        host = (urllib.parse.urlsplit(url).hostname or "").lower()
        allowed = self.config.allowed_media_domains
        if allowed is not None and host not in allowed:
            raise InvalidArgumentError(field, f"the domain {host!r} is not allowed (--allowed-media-domains)")
        deadline = time.monotonic() + self.config.media_fetch_timeout_s
        try:
            with urllib.request.urlopen(url, timeout=self.config.media_fetch_timeout_s) as response:
                data = bytearray()
                while chunk := response.read(_CHUNK):
                    data += chunk
                    if len(data) > self.config.max_image_bytes:
                        raise self._too_big(field)
                    if time.monotonic() > deadline:
                        raise TimeoutError
                return bytes(data)
        except InvalidArgumentError:
            raise
        except urllib.error.HTTPError as exc:
            raise InvalidArgumentError(field, f"fetching the image failed: HTTP {exc.code}") from None
        except TimeoutError:
            raise InvalidArgumentError(field, f"the image took longer than {self.config.media_fetch_timeout_s}s "
                                       "to load") from None
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            if isinstance(reason, TimeoutError):
                raise InvalidArgumentError(field, f"the image took longer than {self.config.media_fetch_timeout_s}s "
                                           "to load") from None
            raise InvalidArgumentError(field, f"fetching the image failed: {reason}") from None

    def _file(self, field: str, url: str) -> bytes:
        if self.local_root is None:
            raise InvalidArgumentError(field, "file: URLs are refused (the server has no --allowed-local-media-path)")
        path = Path(urllib.parse.unquote(urllib.parse.urlsplit(url).path)).resolve()
        if not path.is_relative_to(self.local_root):
            raise InvalidArgumentError(field, f"{path} is outside --allowed-local-media-path")
        try:
            if path.stat().st_size > self.config.max_image_bytes:
                raise self._too_big(field)
            return path.read_bytes()
        except OSError as exc:
            raise InvalidArgumentError(field, f"cannot read the image: {exc.strerror}") from None

    def _too_big(self, field: str) -> InvalidArgumentError:
        return InvalidArgumentError(field, f"the image is larger than {self.config.max_image_bytes} bytes "
                                    "(--max-image-bytes)")

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def decode_image(field: str, data: bytes) -> Image.Image:
    """The decoded image (pixels loaded), or an ``InvalidArgumentError`` naming ``field``."""
    from PIL import Image  # imported here: the CLI (every role) reads this module's flags

    try:
        image = Image.open(io.BytesIO(data))
        image.load()
        return image
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise InvalidArgumentError(field, f"cannot decode the image: {exc}") from None
