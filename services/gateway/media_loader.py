"""``MediaLoader``: the images of a chat request, fetched and decoded by a bounded pool of threads.

As vLLM's API server does: ``data:`` URLs (base64) are decoded in place; ``http(s)`` URLs are
fetched by ``UrlFetcher`` (``url_fetcher.py``: only from the hosts of ``--allowed-media-domains``,
none by default, ``*`` for any; only at public addresses, redirects checked hop by hop, one
deadline of ``--media-fetch-timeout-s`` for the whole fetch, ``--max-image-bytes``); ``file:`` URLs
only under ``allowed_local_path`` (``--allowed-local-media-path``). The pool has ``thread_count``
threads (``GRIDSERVE_MEDIA_LOADING_THREAD_COUNT``, default 8).

An image costs what its bytes say: a request carries at most ``--limit-mm-per-prompt`` images
(vLLM's flag, ``{"image": N}``); they are loaded one after the other, each read from its header
before it is decoded and refused past ``--max-image-pixels``, past ``--max-image-aspect-ratio``,
or past what is left of the request's ``--max-request-image-bytes`` (decoded, 4 bytes a pixel) —
so a 100-byte PNG claiming 50,000 x 50,000 pixels, or a thousand small ones, is a 400 before any
pixel is made. Only common raster formats are opened (``IMAGE_FORMATS``). Every failure is an
``InvalidArgumentError`` naming the content part (HTTP 400).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import io
import json
import logging
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from gridserve.services.gateway.url_fetcher import (
    AddressPolicy,
    Resolver,
    UrlFetcher,
    public_only,
    system_resolver,
)
from gridserve.shared import envs
from gridserve.shared.errors import ConfigError, InvalidArgumentError

if TYPE_CHECKING:
    from PIL import Image

logger = logging.getLogger(__name__)

THREADS_ENV = "GRIDSERVE_MEDIA_LOADING_THREAD_COUNT"
# Pillow opens these only (those its build has): no EPS / PostScript (Ghostscript), no exotic decoders.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
BYTES_PER_PIXEL = 4  # what Pillow holds per pixel of an RGB(A) image, an upper bound for the rest
MODALITIES = ("image", "video", "audio")  # vLLM's names; this server takes images


@dataclass(frozen=True)
class MediaConfig:
    """Where images may come from and what they may cost (``gridserve gateway`` flags)."""

    max_image_bytes: int = 20 << 20  # a data: URL of this size (base64: 4/3) fits the edge's 32 MiB body
    media_fetch_timeout_s: float = 5.0
    allowed_media_domains: Optional[tuple[str, ...]] = None  # None / empty: no remote fetch; "*": any host
    allowed_local_media_path: Optional[str] = None  # None: no file: URLs
    thread_count: int = 8
    max_image_pixels: int = 1 << 24  # 4096 x 4096 (a 12 MP phone photo fits)
    max_image_aspect_ratio: float = 50.0
    max_request_image_bytes: int = 128 << 20  # decoded, all images of one request
    limit_mm_per_prompt: tuple[tuple[str, int], ...] = field(default=(("image", 8),))

    def __post_init__(self) -> None:
        for name in ("max_image_bytes", "max_image_pixels", "max_request_image_bytes"):
            if getattr(self, name) < 1:
                raise ConfigError(name.replace("_", "-"), f"must be a positive integer, got {getattr(self, name)}")
        if not self.max_image_aspect_ratio >= 1:
            raise ConfigError("max-image-aspect-ratio", f"must be >= 1, got {self.max_image_aspect_ratio}")
        if not self.media_fetch_timeout_s > 0:
            raise ConfigError("media-fetch-timeout-s", f"must be > 0, got {self.media_fetch_timeout_s}")

    @property
    def max_images(self) -> int:
        """Images one request may carry (``--limit-mm-per-prompt``'s ``image``)."""
        return dict(self.limit_mm_per_prompt).get("image", 0)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> MediaConfig:
        domains = getattr(args, "allowed_media_domains", None)
        limits = parse_limit_mm_per_prompt(getattr(args, "limit_mm_per_prompt", None))
        return cls(max_image_bytes=args.max_image_bytes, media_fetch_timeout_s=args.media_fetch_timeout_s,
                   allowed_media_domains=tuple(domains) if domains else None,
                   allowed_local_media_path=args.allowed_local_media_path, thread_count=thread_count_from_env(),
                   max_image_pixels=args.max_image_pixels, max_image_aspect_ratio=args.max_image_aspect_ratio,
                   max_request_image_bytes=args.max_request_image_bytes,
                   **({"limit_mm_per_prompt": limits} if limits is not None else {}))

    def to_argv(self) -> list[str]:
        argv = []
        default = MediaConfig()
        for name in ("max_image_bytes", "media_fetch_timeout_s", "max_image_pixels", "max_image_aspect_ratio",
                     "max_request_image_bytes"):
            if getattr(self, name) != getattr(default, name):
                argv += ["--" + name.replace("_", "-"), str(getattr(self, name))]
        if self.allowed_media_domains:
            argv += ["--allowed-media-domains", *self.allowed_media_domains]
        if self.allowed_local_media_path:
            argv += ["--allowed-local-media-path", self.allowed_local_media_path]
        if self.limit_mm_per_prompt != default.limit_mm_per_prompt:
            argv += ["--limit-mm-per-prompt", json.dumps(dict(self.limit_mm_per_prompt))]
        return argv


def parse_limit_mm_per_prompt(text: Optional[str]) -> Optional[tuple[tuple[str, int], ...]]:
    """``'{"image": 4}'`` -> ``(("image", 4),)``; a ``ConfigError`` naming the flag otherwise."""
    if text is None or not text.strip():
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError("limit-mm-per-prompt", f"must be JSON such as '{{\"image\": 4}}': {exc}") from None
    if not isinstance(value, dict):
        raise ConfigError("limit-mm-per-prompt", "must be a JSON object such as '{\"image\": 4}'")
    for name, count in value.items():
        if name not in MODALITIES:
            raise ConfigError("limit-mm-per-prompt", f"unknown modality {name!r} (one of {', '.join(MODALITIES)})")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ConfigError("limit-mm-per-prompt", f"{name}: must be an integer >= 0, got {count!r}")
    return tuple(sorted(value.items()))


def add_media_arguments(parser: argparse.ArgumentParser) -> None:
    d = MediaConfig()
    group = parser.add_argument_group("media (images in chat requests)")
    group.add_argument("--max-image-bytes", type=int, default=d.max_image_bytes,
                       help=f"largest image, encoded, in bytes (default {d.max_image_bytes})")
    group.add_argument("--media-fetch-timeout-s", type=float, default=d.media_fetch_timeout_s,
                       help="seconds one image URL may take to fetch, all of it: DNS, connect, redirects, body "
                            f"(default {d.media_fetch_timeout_s:g})")
    envs.add_option(group, "--allowed-media-domains", nargs="+", metavar="HOST",
                    help="hosts image URLs may name; '*': any host (default: none, no image URL is fetched; "
                         "private, loopback and link-local addresses are refused either way; the variable: "
                         "comma or space separated)")
    envs.add_option(group, "--allowed-local-media-path", metavar="DIR",
                    help="folder file: image URLs may read from (default: none)")
    group.add_argument("--max-image-pixels", type=int, default=d.max_image_pixels,
                       help="most pixels of one image, read from its header before it is decoded, and of the "
                            f"image it is resized to (default {d.max_image_pixels})")
    group.add_argument("--max-image-aspect-ratio", type=float, default=d.max_image_aspect_ratio,
                       help=f"longest over shortest side of an image (default {d.max_image_aspect_ratio:g})")
    group.add_argument("--max-request-image-bytes", type=int, default=d.max_request_image_bytes,
                       help="decoded bytes of all images of one request, 4 a pixel "
                            f"(default {d.max_request_image_bytes})")
    envs.add_option(group, "--limit-mm-per-prompt", metavar="JSON",
                    help="most inputs of each modality in one request, as vLLM's flag: JSON such as "
                         f"'{{\"image\": 4}}' (default: {json.dumps(dict(d.limit_mm_per_prompt))})")


def thread_count_from_env() -> int:
    return envs.GRIDSERVE_MEDIA_LOADING_THREAD_COUNT


class MediaLoader:
    """Loads images by URL in its own bounded thread pool, within the request's budgets.

    ``resolver`` / ``address_allowed``: the fetcher's (tests that serve images on loopback)."""

    def __init__(self, config: Optional[MediaConfig] = None, *, resolver: Resolver = system_resolver,
                 address_allowed: Optional[AddressPolicy] = None) -> None:
        self.config = config or MediaConfig()
        self.pool = ThreadPoolExecutor(max_workers=self.config.thread_count, thread_name_prefix="media-loader")
        self.local_root = (Path(self.config.allowed_local_media_path).resolve()
                           if self.config.allowed_local_media_path else None)
        self.fetcher = UrlFetcher(self.config.allowed_media_domains, self.config.media_fetch_timeout_s,
                                  self.config.max_image_bytes, resolver=resolver,
                                  address_allowed=address_allowed or _address_policy())

    async def load_all(self, urls: list[tuple[str, str]]) -> list[Image.Image]:
        """``(field, url)`` pairs -> decoded images, in order, one at a time within the budgets."""
        self.check_count(urls)
        loop = asyncio.get_running_loop()
        budget = self.config.max_request_image_bytes
        images = []
        for field_name, url in urls:
            try:  # each fetch is bounded by its own deadline; this is only a safety net
                image = await asyncio.wait_for(loop.run_in_executor(self.pool, self.load, field_name, url, budget),
                                               self.config.media_fetch_timeout_s + 5.0)
            except asyncio.TimeoutError:
                raise InvalidArgumentError(field_name, self.fetcher.generic_error) from None
            budget -= decoded_bytes(image.width, image.height)
            images.append(image)
        return images

    def check_count(self, urls: list[tuple[str, str]]) -> None:
        limit = self.config.max_images
        if len(urls) > limit:
            raise InvalidArgumentError(urls[limit][0], f"{len(urls)} images in one request, at most {limit} "
                                       "(--limit-mm-per-prompt)")

    def load(self, field: str, url: str, budget: Optional[int] = None) -> Image.Image:
        """One image, fetched and decoded within ``budget`` decoded bytes (blocking: runs in the pool)."""
        config = self.config
        return decode_image(field, self.fetch(field, url), max_pixels=config.max_image_pixels,
                            max_aspect_ratio=config.max_image_aspect_ratio,
                            budget=config.max_request_image_bytes if budget is None else budget)

    def fetch(self, field: str, url: str) -> bytes:
        scheme = urllib.parse.urlsplit(url).scheme.lower()
        if scheme == "data":
            return self._data_url(field, url)
        if scheme in ("http", "https"):
            return self.fetcher.fetch(field, url)
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
        self.fetcher.close()


def _address_policy() -> AddressPolicy:
    """Public addresses only; with the test hooks on, loopback too (tests' local image servers)."""
    if not envs.GRIDSERVE_TEST_MEDIA_LOOPBACK:
        return public_only
    import ipaddress

    return lambda host, address: ipaddress.ip_address(address).is_loopback or public_only(host, address)


def decoded_bytes(width: int, height: int) -> int:
    return width * height * BYTES_PER_PIXEL


def decode_image(field: str, data: bytes, *, max_pixels: int = MediaConfig.max_image_pixels,
                 max_aspect_ratio: float = MediaConfig.max_image_aspect_ratio,
                 budget: Optional[int] = None) -> Image.Image:
    """The decoded image (pixels loaded), its size checked from the header first; an
    ``InvalidArgumentError`` naming ``field`` for anything past a bound or undecodable."""
    from PIL import Image  # imported here: the CLI (every role) reads this module's flags

    Image.init()
    try:  # reads the header only
        image = Image.open(io.BytesIO(data), formats=[f for f in IMAGE_FORMATS if f in Image.OPEN])
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise InvalidArgumentError(field, f"cannot decode the image: {exc}") from None
    check_image_size(field, image.width, image.height, max_pixels, max_aspect_ratio, budget)
    try:
        image.load()
        return image
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise InvalidArgumentError(field, f"cannot decode the image: {exc}") from None


def check_image_size(field: str, width: int, height: int, max_pixels: int, max_aspect_ratio: float,
                     budget: Optional[int] = None) -> None:
    """An image of ``width`` x ``height`` within the pixel, aspect-ratio and byte bounds."""
    if width < 1 or height < 1:
        raise InvalidArgumentError(field, f"the image is {width}x{height} pixels")
    if width * height > max_pixels:
        raise InvalidArgumentError(field, f"the image is {width}x{height} = {width * height} pixels, more than "
                                   f"{max_pixels} (--max-image-pixels)")
    if max(width, height) / min(width, height) > max_aspect_ratio:
        raise InvalidArgumentError(field, f"the image is {width}x{height}: an aspect ratio above "
                                   f"{max_aspect_ratio:g} (--max-image-aspect-ratio)")
    if budget is not None and decoded_bytes(width, height) > budget:
        raise InvalidArgumentError(field, f"decoded, the image takes {decoded_bytes(width, height)} bytes, more than "
                                   f"the {max(budget, 0)} left of the request's budget (--max-request-image-bytes)")
