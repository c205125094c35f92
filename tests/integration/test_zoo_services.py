"""Zoo architectures through the gRPC services (worker, engine, gateway as processes): Gemma 2
(sliding windows, soft caps, the (1 + w) norms) and Bloom (ALiBi) give transformers' greedy tokens,
prompts longer than Gemma 2's window included."""

from __future__ import annotations

import random

import pytest

from gridserve.shared.rpc.client import make_channel

from .hf_reference import hf_greedy
from .services import address, deployment, gateway_stub, greedy, stream_tokens, token_prompt
from .test_zoo_gpt_family import CHECKPOINTS
from .test_zoo_llama_family import checkpoint as llama_family_checkpoint

pytestmark = pytest.mark.slow
TOKENS = 12


def _bloom() -> str:
    from tests.zoo import zoo_checkpoint

    config_class, config = CHECKPOINTS["bloom"]
    return str(zoo_checkpoint("gpt-family-bloom", config_class, **config))


@pytest.mark.parametrize("model", ["gemma2", "bloom"])
def test_zoo_model_through_the_services_matches_hf(model, tmp_path):
    path = _bloom() if model == "bloom" else llama_family_checkpoint(model)
    rng = random.Random(3)
    prompts = [[rng.randrange(6, 4096) for _ in range(n)] for n in (5, 40, 70)]
    with deployment(path, tmp_path) as launcher, make_channel(address(launcher, "gateway")) as channel:
        stub = gateway_stub(channel)
        for prompt in prompts:
            tokens, _, _ = stream_tokens(stub, token_prompt(prompt, greedy(TOKENS)))
            assert tokens == hf_greedy(path, prompt, TOKENS), f"prompt of {len(prompt)} tokens diverges from HF"
