"""Priority scheduling through the real services (worker, engine, gateway on loopback): with every
engine slot taken by long streams, a ``priority: -1`` request sent to the gateway's gRPC API starts
at once and finishes while they still run; every stream's greedy tokens are those of the in-process
LLM, the preempted one's included."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from gridserve import LLM, SamplingParams
from gridserve.api.gateway.v1 import gateway_pb2

from .services import KV_BYTES, address, deployment, gateway_stub, greedy, token_prompt

pytestmark = pytest.mark.slow

LOW_TOKENS, HIGH_TOKENS = 160, 8
LOW_PROMPTS = [[11, 12, 13, 14], [21, 22, 23], [31, 32, 33, 34, 35], [41, 42]]
HIGH_PROMPT = [51, 52, 53]


@pytest.fixture(scope="module")
def gateway(llama_tiny, tmp_path_factory):
    engine_args = ["--kv-cache-memory-bytes", str(KV_BYTES), "--max-num-seqs", "4", "--scheduling-policy", "priority"]
    with deployment(llama_tiny, tmp_path_factory.mktemp("logs"), engine_args=engine_args,
                    gateway_args=["--allow-client-priority"]) as launcher:
        with grpc.insecure_channel(address(launcher, "gateway")) as channel:
            yield gateway_stub(channel)


def _reference(llama_tiny, prompts: list[list[int]], n: int) -> list[list[int]]:
    llm = LLM(model=str(llama_tiny), kv_cache_memory_bytes=KV_BYTES)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n), use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]
    finally:
        llm.shutdown()


class _Stream(threading.Thread):
    """One streamed Generate: its tokens, when its first token came and when it ended."""

    def __init__(self, stub, request: gateway_pb2.GenerateRequest) -> None:
        super().__init__(daemon=True)
        self.stub, self.request = stub, request
        self.ids: list[int] = []
        self.first = self.end = None
        self.error = None

    def run(self) -> None:
        try:
            for response in self.stub.Generate(self.request, timeout=120):
                if response.token_ids and self.first is None:
                    self.first = time.monotonic()
                self.ids += response.token_ids
        except grpc.RpcError as exc:
            self.error = exc
        self.end = time.monotonic()


def test_a_high_priority_request_runs_at_once_beside_a_saturated_engine(gateway, llama_tiny):
    lows = [_Stream(gateway, token_prompt(p, greedy(LOW_TOKENS))) for p in LOW_PROMPTS]
    for stream in lows:
        stream.request.priority = 1
        stream.start()
    deadline = time.monotonic() + 60
    while any(s.first is None for s in lows) and time.monotonic() < deadline:
        time.sleep(0.01)  # every slot (--max-num-seqs 4) taken, every stream decoding
    high = _Stream(gateway, token_prompt(HIGH_PROMPT, greedy(HIGH_TOKENS)))
    high.request.priority = -1
    high.start()
    high.join(60)
    for stream in lows:
        stream.join(120)
    assert high.error is None and all(s.error is None for s in lows), [high.error] + [s.error for s in lows]
    # it did not wait for a slot to free (one frees only when a low-priority stream ends); no
    # wall-clock ratio here: on a shared 2-core machine a scheduler tick can stretch any interval
    assert high.first < high.end < min(s.end for s in lows)
    reference = _reference(llama_tiny, [*LOW_PROMPTS, HIGH_PROMPT], LOW_TOKENS)
    assert [s.ids for s in lows] == reference[:4]  # the preempted stream included
    assert high.ids == reference[4][:HIGH_TOKENS]


def test_the_int32_bounds_pass_through_to_the_engine(gateway):
    for priority in (-(2**31), 2**31 - 1):
        request = token_prompt(HIGH_PROMPT, greedy(2))
        request.priority = priority
        assert sum(len(r.token_ids) for r in gateway.Generate(request, timeout=30)) == 2
