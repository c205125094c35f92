"""``gridserve eval chat`` against a real deployment of the default model (SmolLM2-135M-Instruct,
worker + engine + gateway + the Envoy edge) with the real ``openai`` client: the score of the
question set through gridserve equals transformers' on the same GGUF weights (its chat template,
greedy ``generate``, the same token budget), answer for answer. The questions go in at once (the
engine batches them: minutes faster on a busy CPU; greedy tokens do not depend on the batch)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gridserve.cli import main
from gridserve.default_model import DEFAULT_MODEL_NAME
from gridserve.evals import chat
from gridserve.launcher import free_port

from .services import ENGINE_ARGS, deployment
from .smollm2 import smollm2_gguf

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gguf() -> Path:
    return smollm2_gguf("torch", "openai")


@pytest.fixture(scope="module")
def edge(gguf, tmp_path_factory):
    with deployment(gguf, tmp_path_factory.mktemp("logs"), edge_port=free_port(),
                    served_model_name=DEFAULT_MODEL_NAME,
                    engine_args=[*ENGINE_ARGS, "--max-model-len", "512"]) as launcher:
        yield launcher


def test_chat_eval_through_the_edge_scores_and_answers_as_transformers(edge, gguf: Path, tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "chat.json"
    assert main(["eval", "chat", "--base-url", f"http://{edge.edge_address}/v1",
                 "--concurrency", "20", "--compare-transformers", str(gguf), "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    ours, reference = report["results"]
    total = len(chat.load_questions())
    assert (ours["backend"], ours["model"], ours["total"]) == ("gridserve", DEFAULT_MODEL_NAME, total)
    assert f"gridserve ({DEFAULT_MODEL_NAME}) {ours['score']}/{total}" in printed
    differing = [(a["question"], a["answer"], b["answer"])
                 for a, b in zip(ours["answers"], reference["answers"]) if a["answer"] != b["answer"]]
    assert differing == []
    assert report["differing_answers"] == []
    assert ours["score"] == reference["score"]
    assert ours["score"] >= total // 2  # the set is one the model mostly answers (see docs/serving/quality.md)
