"""The gateway's Pillow + numpy image preprocessing equals transformers' image processor, and
placeholder expansion gives each image as many tokens as the vision tower makes."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from gridserve.services.gateway.image_processor import ImageProcessor
from gridserve.services.gateway.multimodal import MultiModalProcessor, chat_images
from gridserve.shared.errors import InvalidArgumentError

CONFIGS = [
    {"size": {"shortest_edge": 32}, "crop_size": {"height": 30, "width": 30}},  # the llava-tiny recipe's
    {"size": {"shortest_edge": 224}, "crop_size": {"height": 224, "width": 224}},  # CLIP's
    {"size": {"height": 48, "width": 40}, "do_center_crop": False, "resample": 2,
     "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]},
    {"do_resize": False, "crop_size": {"height": 50, "width": 50}},  # crops bigger than the image pad
]


def _random_image(seed: int, height: int, width: int, mode: str) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).convert(mode)


@pytest.mark.parametrize("config", CONFIGS)
def test_pixels_equal_transformers_image_processor(config):
    from transformers import CLIPImageProcessorPil

    ours = ImageProcessor.from_config(config)
    theirs = CLIPImageProcessorPil(**config)
    for seed, (height, width, mode) in enumerate([(40, 57, "RGB"), (57, 40, "RGB"), (20, 25, "L"),
                                                  (64, 48, "RGBA"), (31, 90, "P"), (45, 45, "CMYK")]):
        image = _random_image(seed, height, width, mode)
        expected = theirs(images=image, return_tensors="np")["pixel_values"][0]
        got = ours(image)
        assert got.dtype == np.float32 and got.shape == expected.shape
        assert np.abs(got - expected).max() <= 1e-5, (config, mode, height, width)
        assert got.shape[1:] == ours.output_size(height, width)


def test_placeholders_expand_to_the_image_tokens_in_prompt_order(llava_tiny):
    mm = MultiModalProcessor.from_model_folder(str(llava_tiny))
    token = mm.image_token_id
    images = [_random_image(1, 40, 50, "RGB"), _random_image(2, 30, 90, "RGB")]
    ids, features = mm.process([1, token, 2, 3, token, 4], images)
    assert [f.offset for f in features] == [1, 28] and [f.length for f in features] == [25, 25]
    assert ids == [1] + [token] * 25 + [2, 3] + [token] * 25 + [4]
    assert features[0].shape == (3, 30, 30) and features[0].identifier != features[1].identifier
    again = mm.process([token], [images[0]])[1][0]
    assert again.identifier == features[0].identifier and again.offset == 0
    with pytest.raises(InvalidArgumentError, match="1 images for 2 image placeholders"):
        mm.process([token, token], images[:1])


def test_text_only_models_have_no_multimodal_processor(llama_tiny):
    assert MultiModalProcessor.from_model_folder(str(llama_tiny)) is None


def test_chat_images_names_each_part_and_leaves_a_template_placeholder():
    messages = [{"role": "system", "content": "hi"},
                {"role": "user", "content": [{"type": "text", "text": "a"},
                                             {"type": "image_url", "image_url": {"url": "data:x"}},
                                             {"type": "image_pil", "image_pil": "PIL"}]}]
    rendered, images = chat_images(messages)
    assert images == [("messages[1].content[1]", "data:x"), ("messages[1].content[2]", "PIL")]
    assert rendered[1]["content"] == [{"type": "text", "text": "a"}, {"type": "image"}, {"type": "image"}]
    assert rendered[0] == messages[0]


def test_a_resize_past_the_pixel_budget_is_refused_before_pillow_allocates_it(monkeypatch):
    from gridserve.services.gateway.image_processor import ImageBudgetError

    processor = ImageProcessor.from_config({"size": {"shortest_edge": 336}, "crop_size": 336})
    assert processor.resize_to(5000, 1) == (1_680_000, 336)  # a 1 x 5000 image: 564 M pixels resized

    def no_resize(*args, **kwargs):
        raise AssertionError("Image.resize was called")

    monkeypatch.setattr(Image.Image, "resize", no_resize)
    tall = Image.new("RGB", (1, 5000))
    with pytest.raises(ImageBudgetError, match="336x1680000"):
        processor(tall)
    mm = MultiModalProcessor(processor, image_token_id=7, patch_size=14, keeps_cls_token=False)
    with pytest.raises(InvalidArgumentError, match="more than 16777216") as err:
        mm.process([1, 7], [tall], field="messages[0].content[0]")
    assert err.value.field == "messages[0].content[0]"
