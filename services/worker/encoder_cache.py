"""``EncoderCache``: the image embeddings of running requests, for the steps that prefill them.

An image's embeddings are computed (the vision encoder and projector, all images a step needs in
one batch) the first time a step covers one of its tokens, kept while a chunked prefill walks
through its tokens, and dropped once the image's last token is computed, or with the request.
Tokens served from the prefix cache are never scheduled, so a fully cached image is never encoded.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gridserve.shared.multimodal import ImageFeature


@dataclass
class ImageRows:
    """Packed rows of this step that are image tokens, and the embeddings that go there."""

    rows: torch.Tensor
    embeds: torch.Tensor


class EncoderCache:
    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.embeds: dict[tuple[str, int], torch.Tensor] = {}
        self.images_encoded = 0  # how many images the encoder has run on (tests, metrics)

    def drop(self, req_id: str) -> None:
        for key in [k for k in self.embeds if k[0] == req_id]:
            del self.embeds[key]

    def step_rows(self, scheduled: list[tuple[str, list[ImageFeature], int, int, int]]) -> ImageRows | None:
        """``scheduled``: ``(req_id, images, first position, token count, first packed row)`` per
        request this step; the image rows among them (None when there are none)."""
        wanted = [(req_id, i, image, start, n, row) for req_id, images, start, n, row in scheduled
                  for i, image in enumerate(images) if image.overlaps(start, start + n)]
        if not wanted:
            return None
        self._encode([(req_id, i, image) for req_id, i, image, *_ in wanted if (req_id, i) not in self.embeds])
        rows, embeds = [], []
        for req_id, i, image, start, n, row in wanted:
            lo, hi = max(start, image.offset), min(start + n, image.end)
            rows.append(torch.arange(row + lo - start, row + hi - start))
            embeds.append(self.embeds[(req_id, i)][lo - image.offset : hi - image.offset])
            if hi == image.end:
                del self.embeds[(req_id, i)]
        return ImageRows(torch.cat(rows).to(self.device), torch.cat(embeds))

    def _encode(self, images: list[tuple[str, int, ImageFeature]]) -> None:
        by_shape: dict[tuple[int, ...], list[tuple[str, int, ImageFeature]]] = {}
        for item in images:
            by_shape.setdefault(item[2].shape, []).append(item)
        for items in by_shape.values():
            pixels = torch.stack([_pixels(image) for _, _, image in items]).to(self.device)
            out = self.model.encode_images(pixels)
            for (req_id, i, image), embeds in zip(items, out):
                if embeds.shape[0] != image.length:
                    raise ValueError(f"request {req_id!r} image {i}: the encoder gives {embeds.shape[0]} "
                                     f"embeddings for {image.length} image tokens")
                self.embeds[(req_id, i)] = embeds
            self.images_encoded += len(items)


def _pixels(image: ImageFeature) -> torch.Tensor:
    return torch.frombuffer(bytearray(image.pixel_values), dtype=torch.float32).view(image.shape)
