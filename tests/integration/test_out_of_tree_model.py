"""An out-of-tree model package (``examples/out_of_tree_model``), pip-installed into a temporary
target, registered through the ``gridserve.general_plugins`` entry point and served end to end."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from gridserve.launcher import free_port
from gridserve.shared.rpc.client import health_status, make_channel

from .hf_reference import hf_greedy
from .services import KV_BYTES, gateway_stub, greedy, stream_tokens, token_prompt

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "out_of_tree_model"

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory) -> Path:
    """The example package pip-installed (entry points included) into a temporary target folder."""
    work = tmp_path_factory.mktemp("plugin")
    shutil.copytree(EXAMPLE, work / "src")  # pip writes build files beside the sources
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(work / "site"), str(work / "src")], check=True, timeout=120)
    return work / "site"


def _env(plugin_path: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(plugin_path), str(REPO)])}


def _checkpoint_as(source: Path, folder: Path, architecture: str) -> Path:
    """``source``'s weights and tokenizer under a config.json naming ``architecture``."""
    folder.mkdir()
    for item in source.iterdir():
        if item.name != "config.json":
            (folder / item.name).symlink_to(item)
    config = json.loads((source / "config.json").read_text())
    config["architectures"] = [architecture]
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_plugin_registers_in_the_torch_free_gateway(plugin_path):
    code = ("import sys, json; import gridserve.services.gateway.main; "
            "from gridserve.shared.plugins import load_general_plugins; from gridserve import ModelRegistry; "
            "print(json.dumps([load_general_plugins(), ModelRegistry.get_supported_archs(), 'torch' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], env=_env(plugin_path), capture_output=True, text=True,
                         timeout=120, check=True).stdout
    plugins, archs, torch_loaded = json.loads(out.strip().splitlines()[-1])
    assert plugins == ["example_model"]
    assert {"ExampleLlamaForCausalLM", "ExampleOldStyleForCausalLM"} <= set(archs)
    assert torch_loaded is False


def test_unknown_architecture_fails_the_engine_config_naming_the_registered_ones(llama_tiny, tmp_path):
    from gridserve.shared.config import GridserveConfig
    from gridserve.shared.errors import ConfigError

    folder = _checkpoint_as(llama_tiny, tmp_path / "unknown", "NoSuchForCausalLM")
    with pytest.raises(ConfigError) as info:
        GridserveConfig.from_kwargs(model=str(folder)).finalize()
    assert info.value.field == "model.architecture"
    assert "NoSuchForCausalLM" in str(info.value) and "LlamaForCausalLM" in str(info.value)


def test_out_of_tree_model_serves_through_gridserve_serve(plugin_path, llama_tiny, tmp_path):
    folder = _checkpoint_as(llama_tiny, tmp_path / "example", "ExampleLlamaForCausalLM")
    cmd = [sys.executable, "-m", "gridserve.cli", "serve", str(folder), "--kv-cache-memory-bytes", str(KV_BYTES),
           "--log-dir", str(tmp_path / "logs"), "--grace-period", "5", "--port", str(free_port())]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True,
                              env=_env(plugin_path))
    try:
        lines = []
        for line in server.stdout:
            lines.append(line)
            if line.startswith("gridserve ready"):
                break
        table = "".join(lines)
        gateway = next(line.split()[2] for line in lines if line.startswith("gateway "))
        with make_channel(gateway) as channel:
            assert health_status(channel) == "SERVING", table
            prompt = [5, 17, 42, 99, 3]
            tokens, _, _ = stream_tokens(gateway_stub(channel), token_prompt(prompt, greedy(8)))
            assert tokens == hf_greedy(str(llama_tiny), prompt, 8)
        worker_log = "".join(p.read_text() for p in (tmp_path / "logs").glob("worker*.log"))
        assert "loaded plugin example_model" in worker_log
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()


def test_old_signature_model_runs_with_one_warning(llama_tiny, tmp_path, monkeypatch):
    from gridserve import LLM, ModelRegistry, SamplingParams

    monkeypatch.syspath_prepend(str(EXAMPLE))
    ModelRegistry.register_model("ExampleOldStyleForCausalLM",
                                 "gridserve_example_model.model:ExampleOldStyleForCausalLM")
    folder = _checkpoint_as(llama_tiny, tmp_path / "old", "ExampleOldStyleForCausalLM")
    with pytest.warns(DeprecationWarning, match="old constructor") as caught:
        llm = LLM(model=str(folder), kv_cache_memory_bytes=KV_BYTES, device="cpu")
    assert len([w for w in caught if "old constructor" in str(w.message)]) == 1
    try:
        prompt = [5, 17, 42, 99, 3]
        out = llm.generate({"prompt_token_ids": prompt},
                           SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8), use_tqdm=False)
    finally:
        llm.shutdown()
        ModelRegistry.unregister("ExampleOldStyleForCausalLM")
    assert list(out[0].outputs[0].token_ids) == hf_greedy(str(llama_tiny), prompt, 8)
