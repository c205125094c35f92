"""Step isolation: a request that fails inside the worker ends with an error; the other requests of
the same batch complete unchanged and the engine never stops serving.

Real processes. The grammar fault is injected with ``GRIDSERVE_TEST_GRAMMAR_FAULT`` (a test-only
hook of the worker's structured-output manager: a spec containing that text breaks on its first
token); out-of-range token ids need no hook: a client that calls the engine directly bypasses the
gateway's validation, and the worker's own check fails that request alone.
"""

from __future__ import annotations

import threading
import urllib.request

import grpc
import pytest

from gridserve.api.common.v1 import common_pb2
from gridserve.api.engine.v1 import engine_pb2
from gridserve.shared.rpc.client import health_status, make_channel

from .services import (
    address,
    deployment,
    engine_stub,
    gateway_stub,
    greedy,
    stream_tokens,
    token_prompt,
)

pytestmark = pytest.mark.slow

FAULT = "GRAMMARFAULT"
PROMPTS = [[11, 12, 13, 14], [21, 22, 23], [31, 32, 33, 34, 35]]
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def services(llama_tiny, tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("GRIDSERVE_TEST_HOOKS", "1")
        patch.setenv("GRIDSERVE_TEST_GRAMMAR_FAULT", FAULT)  # inherited by the worker process
        with deployment(llama_tiny, tmp_path_factory.mktemp("logs")) as launcher:
            yield launcher


def _in_parallel(calls: list) -> list:
    """Run each zero-argument call in its own thread (one batch); results or exceptions, in order."""
    results: list = [None] * len(calls)

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except Exception as exc:  # noqa: BLE001 - returned to the test
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return results


def _recoveries(launcher) -> str:
    engine = next(p for p in launcher.processes if p.role == "engine")
    with urllib.request.urlopen(f"http://{engine.metrics_address}/metrics", timeout=5) as resp:
        return next(line for line in resp.read().decode().splitlines()
                    if line.startswith("gridserve:worker_recoveries_total"))


def test_a_grammar_that_fails_in_the_worker_fails_that_request_alone(services):
    with make_channel(address(services, "gateway")) as channel:
        stub = gateway_stub(channel)
        generate = [lambda p=p: stream_tokens(stub, token_prompt(p, greedy(MAX_TOKENS, ignore_eos=True)))
                    for p in PROMPTS]
        reference = _in_parallel(generate)
        assert all(len(ids) == MAX_TOKENS for ids, _, _ in reference), reference

        structured = common_pb2.SamplingParams(
            temperature=0.0, max_tokens=MAX_TOKENS,
            structured_outputs=common_pb2.StructuredOutputsParams(regex=f"[a-z ]+({FAULT})?"))
        doomed = lambda: stream_tokens(stub, token_prompt([51, 52, 53], structured))  # noqa: E731
        *others, failed = _in_parallel([*generate, doomed])

        assert isinstance(failed, grpc.RpcError), failed
        assert failed.code() == grpc.StatusCode.INTERNAL
        assert "injected grammar fault" in failed.details()
        assert others == reference
        assert health_status(channel) == "SERVING"
        assert stream_tokens(stub, token_prompt(PROMPTS[0], greedy(MAX_TOKENS, ignore_eos=True))) == reference[0]
    assert _recoveries(services).endswith(" 0.0")


def test_token_ids_out_of_range_sent_straight_to_the_engine_fail_only_that_request(services):
    """The engine checks what a gateway sends before it queues it (INVALID_ARGUMENT naming the
    field); the requests beside the refused ones run as if alone. (The worker's own check, for ids
    that reach it anyway, is covered by tests/unit/worker/test_request_failures.py.)"""
    vocab = 10_000_000  # beyond any vocabulary
    bad = {
        "bad-prompt": engine_pb2.AddRequestRequest(prompt_token_ids=[5, vocab], sampling_params=greedy(8)),
        "bad-bias": engine_pb2.AddRequestRequest(prompt_token_ids=[5, 6, 7],
                                                 sampling_params=greedy(8, logit_bias={vocab: 5.0})),
    }
    good = {f"good-{i}": engine_pb2.AddRequestRequest(prompt_token_ids=p, sampling_params=greedy(MAX_TOKENS))
            for i, p in enumerate(PROMPTS)}
    refused: dict[str, grpc.RpcError] = {}
    with make_channel(address(services, "engine")) as channel:
        stub = engine_stub(channel)
        outputs = stub.StreamOutputs(engine_pb2.StreamOutputsRequest(gateway_id="isolation-test"), timeout=60)
        next(outputs)  # the stream is open
        for request_id, request in {**bad, **good}.items():
            request.request_id, request.gateway_id = request_id, "isolation-test"
            try:
                stub.AddRequest(request, timeout=10)
            except grpc.RpcError as exc:
                refused[request_id] = exc
        tokens: dict[str, list[int]] = {r: [] for r in good}
        finished: dict[str, engine_pb2.EngineCoreOutput] = {}
        for batch in outputs:
            for out in batch.outputs:
                tokens[out.request_id] += out.new_token_ids
                if out.finish_reason:
                    finished[out.request_id] = out
            if len(finished) == len(tokens):
                break
        outputs.cancel()
        assert health_status(channel) == "SERVING"
    assert set(refused) == set(bad)
    assert all(e.code() == grpc.StatusCode.INVALID_ARGUMENT for e in refused.values())
    assert "prompt_token_ids" in refused["bad-prompt"].details()
    assert "logit_bias" in refused["bad-bias"].details()
    for request_id in good:
        assert finished[request_id].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert len(tokens[request_id]) == MAX_TOKENS
    with make_channel(address(services, "gateway")) as channel:  # the same tokens as alone
        stub = gateway_stub(channel)
        for i, prompt in enumerate(PROMPTS):
            assert stream_tokens(stub, token_prompt(prompt, greedy(MAX_TOKENS)))[0] == tokens[f"good-{i}"]
    assert _recoveries(services).endswith(" 0.0")
