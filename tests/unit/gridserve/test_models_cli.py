"""``gridserve models``: the supported-models table from the registry's metadata (no torch, no model
module imported), the built-ins with their features and the architectures plugins registered."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gridserve.cli import main
from gridserve.shared.model_registry import ARCHITECTURES, ModelRegistry

REPO = Path(__file__).resolve().parents[3]


def _json_rows(capsys) -> dict[str, dict]:
    assert main(["models", "--format", "json"]) == 0
    return {row["architecture"]: row for row in json.loads(capsys.readouterr().out)}


def test_every_built_in_architecture_is_listed_with_the_registrys_features(capsys):
    rows = _json_rows(capsys)
    for name, info in ARCHITECTURES.items():
        row = rows[name]
        assert row["source"] == "built-in"
        assert row["examples"] == list(info.examples)
        assert (row["tensor_parallel"], row["pipeline_parallel"], row["quantization"], row["multimodal"],
                row["kv_kind"]) == (info.tensor_parallel, info.pipeline_parallel, info.quantization,
                                    info.multimodal, info.kv_kind)
    assert rows["LlavaForConditionalGeneration"]["multimodal"] is True
    assert rows["OPTForCausalLM"]["pipeline_parallel"] is False


@pytest.fixture()
def plugin_models():
    """A new architecture and a replaced built-in, as a plugin registers them (lazy strings)."""
    ModelRegistry.register_model("ToyForCausalLM", "toy_plugin.models:ToyForCausalLM")
    ModelRegistry.register_model("GPT2LMHeadModel", "toy_plugin.models:FastGPT2")
    yield
    ModelRegistry.unregister("ToyForCausalLM")
    ModelRegistry.unregister("GPT2LMHeadModel")


def test_plugin_architectures_are_listed_and_marked_plugin(capsys, plugin_models):
    rows = _json_rows(capsys)
    toy = rows["ToyForCausalLM"]
    assert toy["source"] == "plugin (toy_plugin.models:ToyForCausalLM)"
    # The engine refuses TP / PP for an architecture it has no metadata for; the rest is the plugin's.
    assert (toy["tensor_parallel"], toy["pipeline_parallel"]) == (False, False)
    assert (toy["quantization"], toy["multimodal"], toy["kv_kind"]) == (None, None, None)
    assert rows["GPT2LMHeadModel"]["source"] == "plugin (toy_plugin.models:FastGPT2)"
    assert rows["GPT2LMHeadModel"]["tensor_parallel"] is True  # the built-in's metadata still gates TP


def test_the_text_table_has_a_header_and_one_aligned_line_per_architecture(capsys, plugin_models):
    assert main(["models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["architecture", "TP", "PP"]
    assert len(lines) == 1 + len(set(ARCHITECTURES) | {"ToyForCausalLM"})
    gemma2 = next(line for line in lines if line.startswith("Gemma2ForCausalLM "))
    assert gemma2.split()[1:7] == ["yes", "yes", "yes", "no", "sliding", "built-in"]
    assert gemma2.endswith("google/gemma-2-2b-it")
    toy = next(line for line in lines if line.startswith("ToyForCausalLM "))
    assert toy.split()[1:8] == ["no", "no", "—", "—", "—", "plugin", "(toy_plugin.models:ToyForCausalLM)"]
    tp = lines[0].index(" TP ") + 1
    assert all(line[tp:tp + 4].rstrip() in ("yes", "no") for line in lines[1:])  # the columns line up


def test_the_markdown_table_links_each_example_checkpoint(capsys):
    assert main(["models", "--format", "markdown"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("| architecture | TP | PP | quantization | multimodal | KV cache | source |")
    assert "| `Qwen3ForCausalLM` | yes | yes | yes | no | sliding | built-in | " \
           "[Qwen/Qwen3-0.6B](https://huggingface.co/Qwen/Qwen3-0.6B) |" in out


def test_the_command_runs_without_torch_or_any_model_module():
    code = ("import sys; from gridserve.cli import main; rc = main(['models']); "
            "loaded = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers') "
            "or m.startswith('gridserve.services.worker')]; print('LOADED', loaded); sys.exit(rc)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "LlamaForCausalLM" in out.stdout and "LOADED []" in out.stdout


def test_the_supported_models_page_lists_every_built_in():
    page = (REPO / "docs" / "serving" / "supported-models.md").read_text(encoding="utf-8")
    for name in ARCHITECTURES:
        assert f"| `{name}` |" in page, name
