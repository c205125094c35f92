"""Llava (CLIP vision tower + projector + Llama) is token-exact with transformers'
``LlavaForConditionalGeneration.generate`` on the same checkpoint and images, and its prefix cache
keys image blocks by the image's content."""

from __future__ import annotations

import base64
import functools
import io

import numpy as np
import pytest
import torch
from PIL import Image

from gridserve import LLM, SamplingParams

MAX_TOKENS = 10
USER = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


def _image(seed: int, height: int = 40, width: int = 52) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


@functools.lru_cache(maxsize=1)
def _hf(path: str):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    return AutoProcessor.from_pretrained(path), LlavaForConditionalGeneration.from_pretrained(path).eval()


@torch.inference_mode()
def hf_llava_greedy(path: str, prompt: str, images: list[Image.Image], n: int = MAX_TOKENS) -> list[int]:
    processor, model = _hf(str(path))
    inputs = processor(text=prompt, images=images or None, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def _greedy(n: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n)


@pytest.fixture(scope="module")
def llm(llava_tiny):
    engine = LLM(model=str(llava_tiny), kv_cache_memory_bytes=16 << 20, max_num_batched_tokens=64,
                 block_size=8)
    yield engine
    engine.shutdown()


def _ids(llm: LLM, prompts: list[dict]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(), use_tqdm=False)]


def test_one_image_matches_hf(llm, llava_tiny):
    prompt = USER.format("<image>What is in the picture?")
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": _image(1)}}, _greedy(), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_llava_greedy(llava_tiny, prompt, [_image(1)])
    assert len(out.prompt_token_ids) == len(llm.get_tokenizer().encode(prompt)) - 1 + 25  # 25 image tokens


def test_different_images_give_different_answers(llm):
    prompt = USER.format("<image>What is in the picture?")
    first, second = _ids(llm, [{"prompt": prompt, "multi_modal_data": {"image": _image(s)}} for s in (2, 3)])
    assert first != second


def test_two_images_in_one_message_match_hf(llm, llava_tiny):
    prompt = USER.format("<image> and <image>: which is brighter?")
    images = [_image(4), _image(5, 64, 30)]
    got = _ids(llm, [{"prompt": prompt, "multi_modal_data": {"image": images}}])[0]
    assert got == hf_llava_greedy(llava_tiny, prompt, images)
    swapped = _ids(llm, [{"prompt": prompt, "multi_modal_data": {"image": images[::-1]}}])[0]
    assert swapped == hf_llava_greedy(llava_tiny, prompt, images[::-1]) and swapped != got


def test_image_with_long_prompt_under_chunked_prefill_matches_hf(llm, llava_tiny):
    # max_num_batched_tokens=64: the ~200-token prompt is prefilled in chunks; the first ends inside the image.
    text = "def walk(tree):\n    for node in tree.children:\n        yield from walk(node)\n" * 6
    prompt = USER.format(text[:120] + "<image>" + text[120:])
    out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": _image(6)}}, _greedy(), use_tqdm=False)[0]
    image_at = out.prompt_token_ids.index(llm.llm_engine.input_processor.multimodal.image_token_id)
    assert image_at < 64 < image_at + 25 and len(out.prompt_token_ids) > 3 * 64
    assert out.outputs[0].token_ids == hf_llava_greedy(llava_tiny, prompt, [_image(6)])


def test_batch_mixing_image_and_text_requests_matches_hf(llm, llava_tiny):
    prompts = [USER.format("<image>Describe."), USER.format("Say something about trees."),
               USER.format("Two: <image><image>"), USER.format("def f(x):")]
    images = [[_image(7)], [], [_image(8), _image(9)], []]
    requests = [{"prompt": p, "multi_modal_data": {"image": i}} if i else {"prompt": p}
                for p, i in zip(prompts, images)]
    got = _ids(llm, requests)
    for i, (prompt, imgs) in enumerate(zip(prompts, images)):
        assert got[i] == hf_llava_greedy(llava_tiny, prompt, imgs), f"request {i}"


def test_chat_with_data_url_image_part_matches_generate(llm):
    buffer = io.BytesIO()
    _image(10).save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "What is it?"}]}]
    chat = llm.chat(messages, _greedy(), use_tqdm=False)[0].outputs[0].token_ids
    pil = llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": _image(10)},
                                                 {"type": "text", "text": "What is it?"}]}],
                   _greedy(), use_tqdm=False)[0].outputs[0].token_ids
    direct = _ids(llm, [{"prompt": USER.format("<image>What is it?"), "multi_modal_data": {"image": _image(10)}}])[0]
    assert chat == pil == direct


def test_same_image_reuses_cached_image_blocks_and_a_different_image_does_not(llm):
    llm.reset_prefix_cache()
    runner = llm.llm_engine.core.executor.worker.runner
    prompt = USER.format("<image>What is in the picture?")
    first = llm.generate({"prompt": prompt, "multi_modal_data": {"image": _image(11)}}, _greedy(), use_tqdm=False)[0]
    encoded = runner.encoder_cache.images_encoded
    again = llm.generate({"prompt": prompt, "multi_modal_data": {"image": _image(11)}}, _greedy(), use_tqdm=False)[0]
    image_end = 1 + 3 + 25  # <|im_start|>user\n, then the image's tokens
    assert again.num_cached_tokens >= image_end  # the hits cover the image's tokens
    assert runner.encoder_cache.images_encoded == encoded  # the encoder did not run again
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    other = llm.generate({"prompt": prompt, "multi_modal_data": {"image": _image(12)}}, _greedy(), use_tqdm=False)[0]
    image_start = len(llm.get_tokenizer().encode("<|im_start|>user\n"))
    assert other.num_cached_tokens <= image_start  # only blocks before the image may hit
    assert runner.encoder_cache.images_encoded == encoded + 1


def test_images_refused_by_a_text_only_model(llama_tiny):
    from gridserve.shared.errors import InvalidArgumentError

    text_only = LLM(model=str(llama_tiny), kv_cache_memory_bytes=8 << 20)
    try:
        with pytest.raises(InvalidArgumentError) as err:
            text_only.generate({"prompt": "hi", "multi_modal_data": {"image": _image(0)}}, use_tqdm=False)
        assert err.value.field == "multi_modal_data.image"
    finally:
        text_only.shutdown()


def test_wrong_number_of_images_is_refused(llm):
    from gridserve.shared.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="2 images for 1 image placeholders"):
        llm.generate({"prompt": USER.format("<image>"), "multi_modal_data": {"image": [_image(0), _image(1)]}},
                     use_tqdm=False)


def test_each_tp_rank_reads_only_its_half_of_the_tower_projector_and_language_model(llava_tiny):
    from gridserve.services.worker.loader import load_model
    from gridserve.services.worker.parallel_state import ParallelState, set_parallel_state
    from gridserve.shared.config import GridserveConfig
    from gridserve.shared.parallel import RankLayout

    sharded = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "out_proj.weight",
               "fc1.weight", "fc2.weight", "linear_1.weight", "linear_2.weight", "gate_proj.weight")
    config = GridserveConfig.from_kwargs(model=str(llava_tiny), tensor_parallel_size=2).finalize()
    try:
        for rank in range(2):
            set_parallel_state(ParallelState(RankLayout(rank, 2, 1)))
            report = load_model(config, torch.device("cpu")).load_report
            names = [n for n in report.read if n.endswith(sharded)]
            assert any("vision_tower" in n for n in names) and any("projector" in n for n in names)
            assert report.max_fraction(names) <= 0.5, {n: report.fraction(n) for n in names}
            # the tower is built up to the feature layer (-2 of 2): its last layer is never read
            assert not any("encoder.layers.1." in n or "post_layernorm" in n for n in report.read)
    finally:
        set_parallel_state(ParallelState.single())


@pytest.mark.slow
def test_tensor_parallel_llava_matches_hf(llava_tiny):
    llm = LLM(model=str(llava_tiny), kv_cache_memory_bytes=8 << 20, tensor_parallel_size=2)
    try:
        prompt = USER.format("<image> and <image>")
        images = [_image(13), _image(14)]
        got = _ids(llm, [{"prompt": prompt, "multi_modal_data": {"image": images}}])[0]
        assert got == hf_llava_greedy(llava_tiny, prompt, images)
    finally:
        llm.shutdown()


def test_preempted_image_requests_resume_and_match_hf(llava_tiny):
    # 9 blocks of 16 tokens for 4 requests that need 4 each: some are preempted, then recomputed
    # from their prompt (the images re-sent, re-encoded) plus the tokens they had.
    llm = LLM(model=str(llava_tiny), kv_cache_memory_bytes=10 * 16 * 512, max_model_len=128, block_size=16)
    try:
        prompts = [USER.format(f"<image>Picture {i}?") for i in range(4)]
        images = [_image(20 + i) for i in range(4)]
        outs = llm.generate([{"prompt": p, "multi_modal_data": {"image": im}} for p, im in zip(prompts, images)],
                            _greedy(24), use_tqdm=False)
        assert llm.stats().num_preemptions > 0
        for i, (prompt, image, out) in enumerate(zip(prompts, images, outs)):
            assert out.outputs[0].token_ids == hf_llava_greedy(llava_tiny, prompt, [image], 24), f"request {i}"
    finally:
        llm.shutdown()
