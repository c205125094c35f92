"""The tokenizer embedded in a GGUF file, converted without torch: the same ids as the source
tokenizer on a few hundred strings (gpt2 and smollm pre-tokenizers), the chat template and special
tokens for the gateway, and a gateway-side import path that never loads torch."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from gridserve.services.gateway.tokenizer import GatewayTokenizer
from gridserve.shared.errors import ConfigError
from gridserve.shared.gguf_tokenizer import tokenizer_from_gguf
from tests.gguf_files import write_gguf


def _strings() -> list[str]:
    """~250 varied strings: stdlib source lines, numbers, unicode, whitespace runs, special tokens."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    lines: list[str] = []
    for name in ("json/decoder.py", "textwrap.py", "fractions.py"):
        lines += [line for line in (stdlib / name).read_text(encoding="utf-8").splitlines() if line.strip()][:60]
    extra = [
        "", " ", "  leading", "trailing  ", "tab\tand\nnewline\r\n", "x = 1234567890 + 3.14159",
        "Grüße, naïve café — déjà vu", "日本語のテキスト", "emoji 🙂🚀 end", "<|im_start|>user\nhi<|im_end|>",
        "<s>bos and </s>eos inline", "don't can't we'll it's", "    def f(self):\n        return 42\n",
        "A" * 300, "1 22 333 4444 55555", "mixed123abc456", "ÀÉÎÕÜ àéîõü", "\u00a0non-breaking\u2003space",
    ]
    return lines + extra + [f"{i} squared is {i * i}" for i in range(0, 2000, 37)]


@pytest.fixture(scope="module")
def llama_gguf(llama_tiny, tmp_path_factory) -> Path:
    return write_gguf(llama_tiny, tmp_path_factory.mktemp("gguf") / "llama-tiny.gguf")


def test_gpt2_encodings_equal_the_source(llama_tiny, llama_gguf):
    source = Tokenizer.from_file(str(llama_tiny / "tokenizer.json"))
    converted = tokenizer_from_gguf(str(llama_gguf)).tokenizer
    strings = _strings()
    assert len(strings) >= 200
    for text in strings:
        ids = source.encode(text).ids
        assert converted.encode(text).ids == ids, text
        assert converted.decode(ids) == source.decode(ids), text
    assert converted.get_vocab_size() == source.get_vocab_size()


def test_smollm_pre_tokenizer(llama_tiny, tmp_path):
    """llama.cpp's ``smollm``: digits one at a time, then GPT-2's split (SmolLM2's tokenizer.json)."""
    data = json.loads((llama_tiny / "tokenizer.json").read_text())
    data["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True}, data["pre_tokenizer"]]}
    source = Tokenizer.from_str(json.dumps(data))
    path = write_gguf(llama_tiny, tmp_path / "smollm.gguf", pre="smollm", tokenizer_json=data)
    converted = tokenizer_from_gguf(str(path)).tokenizer
    for text in _strings():
        assert converted.encode(text).ids == source.encode(text).ids, text


def test_qwen2_pre_tokenizer_equals_transformers_qwen2_tokenizer(qwen2_tiny, tmp_path):
    """llama.cpp's ``qwen2``: the reference is transformers' own Qwen2Tokenizer (which rebuilds the
    split from the vocabulary and merges, whatever tokenizer.json's pre-tokenizer says)."""
    from transformers import AutoTokenizer

    source = AutoTokenizer.from_pretrained(str(qwen2_tiny))
    assert type(source).__name__ == "Qwen2Tokenizer"
    path = write_gguf(qwen2_tiny, tmp_path / "qwen2.gguf", pre="qwen2")
    converted = tokenizer_from_gguf(str(path)).tokenizer
    for text in _strings() + ["e\u0301 composed NFC", "x\r\n\r\n  y", "12345 678"]:
        assert converted.encode(text).ids == source.encode(text), text


@pytest.mark.parametrize("add_bos", [None, False])
def test_sentencepiece_llama_tokenizer_equals_transformers(llama_tiny, tmp_path, add_bos):
    """``tokenizer.ggml.model = llama`` (SentencePiece BPE, no merges: implied by the scores, bytes as
    ``<0xNN>``): the same ids and text as transformers' own conversion of the file."""
    from transformers import AutoTokenizer

    from tests.gguf_files import sentencepiece_vocab

    strings = _strings()
    path = write_gguf(llama_tiny, tmp_path / "spm.gguf", add_bos=add_bos,
                      sentencepiece=sentencepiece_vocab(strings[:150]))
    reference = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    converted = tokenizer_from_gguf(str(path)).tokenizer
    for text in strings:
        ids = reference.encode(text)
        assert converted.encode(text).ids == ids, text
        for skip in (False, True):
            assert converted.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)
    # llama.cpp adds a BOS to a SentencePiece vocabulary unless the file says not to
    assert (converted.encode("x").ids[0] == 1) == (add_bos is None)


def test_gateway_tokenizer_from_gguf(llama_tiny, llama_gguf):
    folder, embedded = GatewayTokenizer(str(llama_tiny)), GatewayTokenizer(str(llama_gguf))
    assert embedded.eos_token == folder.eos_token == "</s>"
    assert embedded.eos_token_id == folder.eos_token_id
    assert embedded.bos_token == folder.bos_token
    assert embedded.chat_template == folder.chat_template
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def f(x): 12"}]
    assert embedded.apply_chat_template(messages) == folder.apply_chat_template(messages)
    # add_bos false in the file: a plain encode adds nothing, as the source tokenizer
    assert embedded.encode("x = 1") == folder.encode("x = 1")
    ids = embedded.encode("<|im_start|>user", add_special_tokens=True)
    assert ids[0] == 4 and embedded.decode(ids, skip_special_tokens=True) == "user"


def test_add_bos_from_metadata(llama_tiny, tmp_path):
    path = write_gguf(llama_tiny, tmp_path / "bos.gguf", add_bos=True)
    tok = tokenizer_from_gguf(str(path)).tokenizer
    assert tok.encode("x").ids[0] == 1 and tok.encode("x", add_special_tokens=False).ids[0] != 1


def test_unsupported_pre_tokenizer(llama_tiny, tmp_path):
    path = write_gguf(llama_tiny, tmp_path / "pre.gguf", pre="deepseek-coder")
    with pytest.raises(ConfigError, match="tokenizer.ggml.pre 'deepseek-coder'") as info:
        tokenizer_from_gguf(str(path))
    assert str(path) in str(info.value) and info.value.field == "tokenizer"


def test_gateway_side_gguf_path_imports_no_torch(llama_gguf):
    """The engine's config and the gateway's tokenizer from a .gguf, in a fresh interpreter: no torch
    (nor transformers, which imports it)."""
    code = f"""
import sys
from gridserve.shared.config import GridserveConfig
from gridserve.services.gateway.tokenizer import GatewayTokenizer
config = GridserveConfig.from_kwargs(model={str(llama_gguf)!r}).finalize()
tok = GatewayTokenizer(config.model.tokenizer_path)
assert config.model.architecture == "LlamaForCausalLM", config.model.architecture
assert tok.encode("def f(): pass") and tok.chat_template
bad = [m for m in ("torch", "transformers", "triton") if m in sys.modules]
assert not bad, bad
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
