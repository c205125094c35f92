"""The fuzz suite (issue 18), a bounded run: a few hundred generated requests of every shape through
the real Envoy edge of one ``gridserve serve``-like stack with small limits (``benchmarks/fuzz.py``
says what is sent and what passes). Every answer is 2xx or 4xx in OpenAI's shape (a gRPC call OK or
INVALID_ARGUMENT), none hangs; afterwards health is SERVING and the engine holds no request and no
KV block. The image cases (issue 38) go to this text-only model: every image, hostile or not, is a
400 naming its part, and the local image server is never asked for anything (the vision-model
side is in test_hostile_images.py). The counts are printed. The long run is one command: ``gridserve bench fuzz --examples N``
(``make fuzz``).
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("hypothesis")
pytest.importorskip("schemathesis")

from gridserve.benchmarks.fuzz import (  # noqa: E402 - after the skips
    ENGINE_ARGS,
    GATEWAY_ARGS,
    Fuzzer,
    MediaServer,
    edge_limits,
    fuzz,
    media_problems,
    openapi_of,
    settled,
)
from gridserve.launcher import free_port  # noqa: E402

from .services import address, deployment  # noqa: E402

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("GRIDSERVE_FUZZ_EXAMPLES", "300"))
SEED = int(os.environ.get("GRIDSERVE_FUZZ_SEED", "18"))


@pytest.fixture(scope="module")
def stack(llama_tiny, tmp_path_factory):
    with deployment(llama_tiny, tmp_path_factory.mktemp("logs"), edge_port=free_port(), engine_args=ENGINE_ARGS,
                    gateway_args=GATEWAY_ARGS, edge_limits=edge_limits()) as launcher:
        yield launcher


def test_generated_requests_never_get_a_5xx_a_hang_or_a_leak(stack, llama_tiny, capsys):
    fuzzer = Fuzzer(stack.edge_address, str(llama_tiny))
    with MediaServer() as media:
        try:
            fuzz(fuzzer, openapi_of(stack.edge_address), EXAMPLES, SEED, media, vision=False)
        finally:
            fuzzer.close()
    problems = settled(stack.edge_address, address(stack, "engine"), address(stack, "gateway"))
    problems += media_problems(media, fetches_from_it=False)
    with capsys.disabled():
        print(f"\nfuzz (seed {SEED}):\n{fuzzer.table()}")
    assert not fuzzer.failures, "\n".join(fuzzer.failures[:10])
    assert not problems, problems
    routes = {route for route, _ in fuzzer.counts}
    assert len(routes) == 5, fuzzer.counts  # every REST route and gRPC Generate were tried
    images = [label for label in fuzzer.labels if label.startswith("image ")]
    assert {"image bomb-8000x8000", "image aspect-1x5000", "image count-100", "image url-slow",
            "image url-redirect-to-127.0.0.1"} <= set(images), images
    # Both kinds of answer were seen: the fuzzer reached the engine, not only the validation.
    assert any(s == "200" for _, s in fuzzer.counts) and any(s == "400" for _, s in fuzzer.counts)
