"""``MultiModalProcessor``: a vision-language model's images into its prompt, on the gateway.

Read from the model folder: ``config.json`` (a ``vision_config``, the image token, the feature
select strategy) and the image processor (``preprocessor_config.json``, or the ``image_processor``
of ``processor_config.json``). ``process`` preprocesses each image (``ImageProcessor``), expands
each image placeholder token of the prompt into as many image tokens as the vision tower gives
embeddings, and returns the ``ImageFeature``s (pixels, positions, content hash) the engine and
the worker take. A model without ``vision_config`` has no processor: images are refused.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Optional

import numpy as np
from PIL import Image

from gridserve.services.gateway.image_processor import ImageBudgetError, ImageProcessor
from gridserve.shared.errors import InvalidArgumentError
from gridserve.shared.multimodal import ImageFeature

logger = logging.getLogger(__name__)


class MultiModalProcessor:
    """Preprocessing and placeholder expansion for one vision-language model."""

    def __init__(self, image_processor: ImageProcessor, image_token_id: int, patch_size: int,
                 keeps_cls_token: bool) -> None:
        self.image_processor = image_processor
        self.image_token_id = image_token_id
        self.patch_size = patch_size
        self.keeps_cls_token = keeps_cls_token

    @classmethod
    def from_model_folder(cls, folder: str) -> Optional[MultiModalProcessor]:
        """The processor of the model in ``folder``; None for a text-only model."""
        path = Path(folder)
        config_file = path / "config.json"
        if not config_file.is_file():
            return None
        config = json.loads(config_file.read_text(encoding="utf-8"))
        vision = config.get("vision_config")
        if not vision:
            return None
        token = config.get("image_token_index", config.get("image_token_id"))
        strategy = config.get("vision_feature_select_strategy", "default")
        return cls(ImageProcessor.from_config(_image_processor_config(path)), int(token),
                   int(vision["patch_size"]), keeps_cls_token=strategy == "full")

    def num_image_tokens(self, height: int, width: int) -> int:
        """Image tokens of an image of this size (after preprocessing)."""
        h, w = self.image_processor.output_size(height, width)
        return (h // self.patch_size) * (w // self.patch_size) + (1 if self.keeps_cls_token else 0)

    def process(self, token_ids: list[int], images: list[Any], field: str = "multi_modal_data.image",
                ) -> tuple[list[int], list[ImageFeature]]:
        """``token_ids`` with each image placeholder expanded, and the images as features."""
        places = [i for i, t in enumerate(token_ids) if t == self.image_token_id]
        if len(places) != len(images):
            raise InvalidArgumentError(field, f"{len(images)} images for {len(places)} image placeholders in "
                                       "the prompt (one image token per image)")
        expanded: list[int] = []
        features: list[ImageFeature] = []
        previous = 0
        for i, (place, image) in enumerate(zip(places, images)):
            pixels = self.preprocess(image, f"{field}[{i}]" if len(images) > 1 else field)
            length = self.num_image_tokens(image.height, image.width)
            expanded.extend(token_ids[previous:place])
            features.append(ImageFeature(pixels.astype("<f4").tobytes(), tuple(pixels.shape), len(expanded), length))
            expanded.extend([self.image_token_id] * length)
            previous = place + 1
        expanded.extend(token_ids[previous:])
        return expanded, features

    def preprocess(self, image: Any, field: str) -> np.ndarray:
        if not isinstance(image, Image.Image):
            raise InvalidArgumentError(field, f"expected a PIL image, got {type(image).__name__}")
        try:
            return self.image_processor(image)
        except ImageBudgetError as exc:
            raise InvalidArgumentError(field, str(exc)) from None
        except (OSError, ValueError) as exc:
            raise InvalidArgumentError(field, f"cannot decode the image: {exc}") from None


def _image_processor_config(folder: Path) -> dict:
    pre = folder / "preprocessor_config.json"
    if pre.is_file():
        return json.loads(pre.read_text(encoding="utf-8"))
    processor = folder / "processor_config.json"
    if processor.is_file():
        return json.loads(processor.read_text(encoding="utf-8")).get("image_processor", {})
    logger.warning("%s has no preprocessor_config.json: CLIP's defaults are used", folder)
    return {}


IMAGE_PART_TYPES = ("image_url", "image_pil")


def chat_images(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[tuple[str, Any]]]:
    """Split a conversation into what the chat template renders (each image part as
    ``{"type": "image"}``, where the model's template puts its image placeholder) and the images,
    in order, as ``(field, source)``: ``messages[i].content[j]`` and a URL or a PIL image."""
    rendered: list[dict[str, Any]] = []
    images: list[tuple[str, Any]] = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            rendered.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type")
            if kind not in IMAGE_PART_TYPES:
                parts.append(part)
                continue
            field = f"messages[{i}].content[{j}]"
            source = part.get(kind)
            if kind == "image_url":
                source = source.get("url") if isinstance(source, dict) else source
                if not isinstance(source, str) or not source:
                    raise InvalidArgumentError(f"{field}.image_url.url", "expected a URL")
            images.append((field, source))
            parts.append({"type": "image"})
        rendered.append({**message, "content": parts})
    return rendered, images
