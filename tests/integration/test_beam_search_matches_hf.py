"""``LLM.beam_search`` returns what transformers' ``generate(num_beams=w, num_return_sequences=w,
do_sample=False)`` returns on the same tiny random checkpoints (Llama, Qwen3, GPT-2, built with
transformers' classes): the same sequences in the same order, scores within 1e-4.

Under ``ignore_eos`` and a fixed ``max_tokens`` (the issue's acceptance) transformers runs without
an EOS (``eos_token_id=None``: EOS is an ordinary token, as ours under ``ignore_eos``). With EOS in
play, a copy of the Llama checkpoint makes its second-best first token the EOS, so a one-token
hypothesis finishes at once and ``length_penalty`` and each ``early_stopping`` decide the result.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

import pytest
import torch

from gridserve import LLM, BeamSearchParams
from tests.zoo import zoo_checkpoint

from .hf_reference import hf_model
from .test_llm_matches_hf import _assert_no_leak, _prompts

WIDTH = 3
MAX_TOKENS = 8
KV_BYTES = 32 << 20
_SIZES = {"num_hidden_layers": 2, "max_position_embeddings": 256}
ARCHITECTURES = {
    "llama": ("LlamaConfig", {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                              "num_key_value_heads": 2, **_SIZES}),
    "qwen3": ("Qwen3Config", {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                              "num_key_value_heads": 2, "head_dim": 24, **_SIZES}),
    "gpt2": ("GPT2Config", {"n_embd": 64, "n_head": 4, "n_layer": 2, "n_positions": 256, "n_inner": 96}),
}


@functools.cache
def checkpoint(arch: str) -> str:
    config_class, config = ARCHITECTURES[arch]
    return str(zoo_checkpoint(f"beam-{arch}", config_class, **config))


@torch.inference_mode()
def hf_beams(path: str, prompt: list[int], width: int, max_tokens: int, eos: bool = True,
             **options) -> list[tuple[list[int], float]]:
    """transformers' beams, best first: (generated tokens, score); without ``eos`` none stops early."""
    ids = torch.tensor([prompt])
    extra = {} if eos else {"eos_token_id": None}
    out = hf_model(path).generate(ids, attention_mask=torch.ones_like(ids), num_beams=width,
                                  num_return_sequences=width, do_sample=False, max_new_tokens=max_tokens,
                                  return_dict_in_generate=True, output_scores=True, **extra, **options)
    eos_id = hf_model(path).config.eos_token_id
    beams = []
    for seq, score in zip(out.sequences, out.sequences_scores.tolist()):
        tokens = seq[len(prompt):].tolist()
        if eos and eos_id in tokens:  # a shorter hypothesis is padded after its EOS
            tokens = tokens[:tokens.index(eos_id) + 1]
        beams.append((tokens, score))
    return beams


def _assert_same_beams(ours, theirs) -> None:
    assert [s.tokens for s in ours.sequences] == [tokens for tokens, _ in theirs]
    for seq, (_, score) in zip(ours.sequences, theirs):
        assert seq.score == pytest.approx(score, abs=1e-4)


@pytest.fixture(scope="module")
def eos_model(tmp_path_factory) -> tuple[str, list[int]]:
    """The Llama checkpoint whose EOS is the prompt's second-best first token."""
    path, prompt = checkpoint("llama"), _prompts(1, 12, 12, seed=5)[0]
    with torch.inference_mode():
        logits = hf_model(path)(torch.tensor([prompt])).logits[0, -1]
    eos = int(logits.topk(2).indices[1])
    out = Path(shutil.copytree(path, tmp_path_factory.mktemp("eos") / "llama"))
    for name in ("config.json", "generation_config.json"):
        if (out / name).exists():
            config = json.loads((out / name).read_text())
            config["eos_token_id"] = eos
            (out / name).write_text(json.dumps(config))
    return str(out), prompt


@pytest.fixture(scope="module")
def llm_eos(eos_model):
    llm = LLM(model=eos_model[0], kv_cache_memory_bytes=KV_BYTES)
    yield llm
    llm.shutdown()


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_beams_under_ignore_eos_equal_transformers_num_beams(arch, request):
    # the Llama is the copy with a likely EOS (which ignore_eos makes an ordinary token): one engine less
    llm = request.getfixturevalue("llm_eos") if arch == "llama" else LLM(model=checkpoint(arch),
                                                                          kv_cache_memory_bytes=KV_BYTES)
    path = llm.config.model.model_path
    prompts = _prompts(2, 4, 24, seed=3)
    try:
        params = BeamSearchParams(beam_width=WIDTH, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
        for prompt, out in zip(prompts, outs):
            assert out.prompt_token_ids == prompt and len(out.sequences) == WIDTH
            assert all(len(s.tokens) == MAX_TOKENS and s.finish_reason == "length" for s in out.sequences)
            _assert_same_beams(out, hf_beams(path, prompt, WIDTH, MAX_TOKENS, eos=False))
            greedy = llm.generate({"prompt_token_ids": prompt}, _greedy(), use_tqdm=False)[0].outputs[0]
            assert out.sequences[0].cum_logprob >= greedy.cumulative_logprob - 1e-5  # never worse than greedy
        _assert_no_leak(llm)
    finally:
        if arch != "llama":
            llm.shutdown()


@pytest.mark.parametrize("length_penalty, early_stopping",
                         [(1.0, False), (1.0, True), (2.0, "never"), (0.0, False), (-1.0, "never")])
def test_beams_ending_in_eos_equal_transformers_with_its_length_penalty_and_early_stopping(
        eos_model, length_penalty, early_stopping, llm_eos):
    path, prompt = eos_model
    params = BeamSearchParams(beam_width=WIDTH, max_tokens=MAX_TOKENS, length_penalty=length_penalty,
                              early_stopping=early_stopping)
    out = llm_eos.beam_search({"prompt_token_ids": prompt}, params)[0]
    theirs = hf_beams(path, prompt, WIDTH, MAX_TOKENS, length_penalty=length_penalty, early_stopping=early_stopping)
    _assert_same_beams(out, theirs)


def test_a_one_token_hypothesis_ending_in_eos_is_returned_with_its_reason(eos_model, llm_eos):
    params = BeamSearchParams(beam_width=WIDTH, max_tokens=MAX_TOKENS, length_penalty=0.0)
    out = llm_eos.beam_search({"prompt_token_ids": eos_model[1]}, params)[0]
    eos = llm_eos.config.model.eos_token_id
    ended = [s for s in out.sequences if s.tokens[-1] == eos]
    assert ended and all(s.finish_reason == "stop" and s.stop_reason is None for s in ended)
    assert [s.tokens for s in ended] == [[eos]]  # the second-best first token ended it at once


def _greedy():
    from gridserve import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
