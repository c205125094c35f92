"""``gridserve serve`` with no model argument serves SmolLM2-135M-Instruct through the edge and
answers like an assistant: the README's first screen, checked."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request

import pytest

from gridserve.default_model import DEFAULT_MODEL_NAME, default_model_file
from gridserve.launcher import free_port
from gridserve.shared.errors import ModelNotFoundError
from tests.missing_tool import missing

pytestmark = pytest.mark.slow
QUESTION = "What is the capital of France? Answer in one sentence."


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def test_serve_without_a_model_answers_the_readme_question(tmp_path):
    try:
        default_model_file()
    except ModelNotFoundError as exc:
        missing(str(exc))
    port = free_port()
    cmd = [sys.executable, "-m", "gridserve.cli", "serve", "--port", str(port), "--max-model-len", "2048",
           "--log-dir", str(tmp_path), "--grace-period", "5"]
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        lines = []
        for line in server.stdout:
            lines.append(line)
            if line.startswith("gridserve ready"):
                break
        assert lines and lines[-1].startswith("gridserve ready"), "".join(lines)
        base = f"http://127.0.0.1:{port}/v1"
        with urllib.request.urlopen(f"{base}/models", timeout=30) as response:
            models = json.loads(response.read())["data"]
        assert [m["id"] for m in models] == [DEFAULT_MODEL_NAME]
        reply = _post(f"{base}/chat/completions", {
            "model": DEFAULT_MODEL_NAME, "temperature": 0, "max_tokens": 32,
            "messages": [{"role": "user", "content": QUESTION}]})
        answer = reply["choices"][0]["message"]["content"]
        assert answer == "The capital of France is Paris.", answer
        assert reply["choices"][0]["finish_reason"] == "stop"
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    assert server.returncode == 0
