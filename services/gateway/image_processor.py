"""``ImageProcessor``: a Hugging Face image processor configuration reproduced with Pillow and numpy.

``preprocessor_config.json`` (CLIP-style, as Llava uses): convert to RGB, resize (the shortest edge
to ``size.shortest_edge`` keeping the aspect ratio, or to ``size.height`` x ``size.width``) with
Pillow's ``resample`` filter on 8-bit pixels, center crop to ``crop_size`` (zero padding an image
smaller than the crop), rescale (``rescale_factor``, in float64 then float32) and normalize
(``image_mean``, ``image_std``), channels first. These are the steps and the arithmetic of
transformers' PIL backend, so the pixels equal its output (to float rounding); the gateway needs
neither torch nor transformers.

An image is never made bigger than ``max_resized_pixels``: the size ``resize_to`` gives is checked
before ``Image.resize`` allocates it (a 1 x 5000 image resized to a shortest edge of 336 would be
336 x 1,680,000 pixels, GBs in Pillow and numpy), and refused with ``ImageBudgetError``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
from PIL import Image

from gridserve.shared.errors import ConfigError

# transformers' OPENAI_CLIP_MEAN / STD: the defaults of CLIP's processor
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_RESIZED_PIXELS = 1 << 24  # as the media loader's --max-image-pixels default


class ImageBudgetError(ValueError):
    """Resizing the image would make more pixels than the processor's budget."""


@dataclass(frozen=True)
class ImageProcessor:
    size: dict
    crop_size: Optional[dict] = None
    resample: int = 3  # PIL.Image.Resampling.BICUBIC
    do_resize: bool = True
    do_center_crop: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    do_convert_rgb: bool = True
    max_resized_pixels: int = MAX_RESIZED_PIXELS

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ImageProcessor:
        """From ``preprocessor_config.json`` (unknown keys ignored); a bad size is a ``ConfigError``."""
        names = {f for f in cls.__dataclass_fields__} - {"max_resized_pixels"}  # ours, not the model's
        kwargs = {k: v for k, v in config.items() if k in names and v is not None}
        for key in ("image_mean", "image_std"):
            if key in kwargs:
                value = kwargs[key]
                kwargs[key] = tuple(value) if isinstance(value, (list, tuple)) else (float(value),) * 3
        size = kwargs.get("size", {"shortest_edge": 224})
        if isinstance(size, int):
            size = {"shortest_edge": size}
        if not ({"shortest_edge"} <= set(size) or {"height", "width"} <= set(size)):
            raise ConfigError("preprocessor_config.size", f"needs shortest_edge or height and width, got {size}")
        kwargs["size"] = size
        crop = kwargs.get("crop_size")
        if isinstance(crop, int):
            kwargs["crop_size"] = {"height": crop, "width": crop}
        return cls(**kwargs)

    def __call__(self, image: Image.Image) -> np.ndarray:
        """float32 ``[channels, height, width]`` pixels, as the model's processor gives them."""
        if self.do_convert_rgb and image.mode != "RGB":
            image = image.convert("RGB")
        if self.do_resize:
            height, width = self.resize_to(image.height, image.width)
            self.check_budget(image.height, image.width, height, width)
            image = image.resize((width, height), resample=self.resample, reducing_gap=None)
        pixels = np.asarray(image)
        if pixels.ndim == 2:
            pixels = pixels[:, :, None]
        pixels = pixels.transpose(2, 0, 1)  # channels first
        if self.do_center_crop and self.crop_size:
            pixels = center_crop(pixels, self.crop_size["height"], self.crop_size["width"])
        if self.do_rescale:
            pixels = (pixels.astype(np.float64) * self.rescale_factor).astype(np.float32)
        if self.do_normalize:
            pixels = pixels.astype(np.float32, copy=False)
            mean = np.array(self.image_mean, dtype=np.float32)[:, None, None]
            std = np.array(self.image_std, dtype=np.float32)[:, None, None]
            pixels = (pixels - mean) / std
        return np.ascontiguousarray(pixels, dtype=np.float32)

    def resize_to(self, height: int, width: int) -> tuple[int, int]:
        """The ``(height, width)`` an image of this size is resized to."""
        if "shortest_edge" not in self.size:
            return self.size["height"], self.size["width"]
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = self.size["shortest_edge"], int(self.size["shortest_edge"] * long / short)
        return (new_long, new_short) if width <= height else (new_short, new_long)

    def check_budget(self, height: int, width: int, new_height: int, new_width: int) -> None:
        """Refuse a resize from ``height x width`` to more than ``max_resized_pixels`` pixels."""
        if new_height * new_width > self.max_resized_pixels:
            raise ImageBudgetError(f"a {width}x{height} image would be resized to {new_width}x{new_height} = "
                                   f"{new_width * new_height} pixels, more than {self.max_resized_pixels}; "
                                   "send an image closer to square")

    def output_size(self, height: int, width: int) -> tuple[int, int]:
        """The ``(height, width)`` of the pixels this processor makes from an image of this size."""
        if self.do_resize:
            height, width = self.resize_to(height, width)
        if self.do_center_crop and self.crop_size:
            height, width = self.crop_size["height"], self.crop_size["width"]
        return height, width


def center_crop(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    """``[C, H, W]`` cropped around the center (top-left rounding down), zero padded when smaller."""
    _, orig_h, orig_w = pixels.shape
    top, left = (orig_h - height) // 2, (orig_w - width) // 2
    if top >= 0 and left >= 0:
        return pixels[:, top : top + height, left : left + width]
    new_h, new_w = max(height, orig_h), max(width, orig_w)
    padded = np.zeros((pixels.shape[0], new_h, new_w), dtype=pixels.dtype)
    pad_top, pad_left = math.ceil((new_h - orig_h) / 2), math.ceil((new_w - orig_w) / 2)
    padded[:, pad_top : pad_top + orig_h, pad_left : pad_left + orig_w] = pixels
    top, left = top + pad_top, left + pad_left
    return padded[:, max(0, top) : min(new_h, top + height), max(0, left) : min(new_w, left + width)]
