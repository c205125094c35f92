"""Multimodal inputs as they cross the roles: one preprocessed image and where its tokens sit.

The gateway decodes and preprocesses an image into float32 pixels (``pixel_values``, raw
little-endian bytes of ``shape``, as the model's image processor would give them) and expands the
prompt's image placeholder into ``length`` image tokens starting at ``offset``. The engine keys the
prefix-cache blocks that cover those tokens by ``identifier`` (a hash of the pixels), so the same
image reuses its KV and a different one at the same place does not. The worker runs the vision
encoder on the pixels and puts its embeddings at those positions. Plain values only: no numpy,
no torch (the engine reads this too).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ImageFeature:
    """One image of a request: its pixels and the prompt positions its embeddings fill."""

    pixel_values: bytes  # float32, little-endian, row-major, ``shape`` (channels, height, width)
    shape: tuple[int, ...]
    offset: int  # first prompt position of the image's tokens
    length: int  # number of image tokens
    identifier: str = ""  # content hash of the pixels (the prefix-cache key); derived when empty

    def __post_init__(self) -> None:
        if len(self.pixel_values) != 4 * math.prod(self.shape):
            raise ValueError(f"pixel_values has {len(self.pixel_values)} bytes; shape {self.shape} "
                             f"needs {4 * math.prod(self.shape)}")
        if not self.identifier:
            object.__setattr__(self, "identifier", content_hash(self.pixel_values, self.shape))

    @property
    def end(self) -> int:
        """One past the last image token."""
        return self.offset + self.length

    def overlaps(self, start: int, end: int) -> bool:
        """Whether any of positions ``[start, end)`` is one of this image's tokens."""
        return self.offset < end and start < self.end


def content_hash(pixel_values: bytes, shape: tuple[int, ...]) -> str:
    """sha256 of the shape and the pixels: equal for equal preprocessed images."""
    digest = hashlib.sha256(repr(tuple(shape)).encode())
    digest.update(pixel_values)
    return digest.hexdigest()
