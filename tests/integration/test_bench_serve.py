"""``gridserve bench serve`` against a real deployment through the Envoy edge (worker, engine,
gateway and Envoy on loopback, the tiny Llama): a handful of short requests, completions and chat."""

from __future__ import annotations

import json

import pytest

from gridserve.cli import main
from gridserve.launcher import free_port

from .services import deployment

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def edge_url(llama_tiny, tmp_path_factory):
    with deployment(llama_tiny, tmp_path_factory.mktemp("logs"), edge_port=free_port()) as launcher:
        yield f"http://{launcher.edge_address}"


def _bench(url: str, out, *extra: str) -> dict:
    rc = main(["bench", "serve", "--base-url", url, "--random-input-len", "12", "--random-output-len", "6",
               "--disable-tqdm", "--timeout", "120", "--max-duration", "300", "--output-json", str(out), *extra])
    assert rc == 0
    return json.loads(out.read_text())


def test_bench_serve_through_envoy_counts_exact_tokens(edge_url, tmp_path):
    report = _bench(edge_url, tmp_path / "completions.json", "--num-prompts", "8", "--max-concurrency", "4",
                    "--random-prefix-len", "4")
    (run,) = report["runs"]
    # the model card's root is the local checkpoint: its tokenizer gives exact token-id prompts
    assert report["workload"]["token_id_prompts"] is True
    assert (run["completed"], run["failed"]) == (8, 0)
    assert run["total_input_tokens"] == 8 * (4 + 12) and run["total_output_tokens"] == 8 * 6
    assert 0 < run["median_ttft_ms"] <= run["median_e2el_ms"]
    assert run["mean_tpot_ms"] > 0 and run["median_itl_ms"] > 0
    assert run["output_throughput"] == pytest.approx(8 * 6 / run["duration"])


def test_bench_serve_chat_through_envoy(edge_url, tmp_path):
    report = _bench(edge_url, tmp_path / "chat.json", "--endpoint", "/v1/chat/completions", "--num-prompts", "4")
    (run,) = report["runs"]
    assert (run["completed"], run["failed"]) == (4, 0)
    assert run["total_output_tokens"] == 4 * 6 and run["total_input_tokens"] > 4 * 12  # + the chat template
