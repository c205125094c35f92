"""Decoder embedders with bidirectional attention (issue 37): Gemma 1 / 2 / 3 checkpoints whose
config.json sets ``use_bidirectional_attention`` (Gemma 3 as EmbeddingGemma ships: a
``Gemma3TextConfig``, the bare model saved, mean pooling and Normalize in its sentence-transformers
files), served by ``LLM(..., runner="pooling").embed`` on tiny random checkpoints built here.

The references, each one unpadded input at a time unless said:

- Gemma 3: transformers' own masks (full layers bidirectional, window layers
  ``|i - j| < sliding_window // 2 + 1``), through its forward and through
  ``SentenceTransformer.encode`` (batched, padded);
- Gemma 1: transformers' forward with SDPA (in transformers 5 the flag reaches Gemma 1 / 2 only as
  the attention modules' ``is_causal``, which SDPA honours when no mask is needed: an eager or a
  padded forward would still be causal);
- Gemma 2: its eager attention (SDPA drops the soft cap) under explicit bidirectional masks,
  the window layers' ``|i - j| < sliding_window`` (the config's window, which Gemma 2 keeps).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from gridserve import LLM
from gridserve.demo import recipe
from gridserve.shared.errors import ConfigError
from tests.zoo import VOCAB

from .test_pooling_models import HIDDEN, TEXTS, _load, _save, _sentence_transformers, _tokenizer

pytest.importorskip("sentence_transformers")

_GEMMA = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": 128, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 256,
          "bos_token_id": recipe.BOS_ID, "eos_token_id": recipe.EOS_ID, "pad_token_id": recipe.PAD_ID,
          "use_bidirectional_attention": True}
_GEMMA3 = {"num_hidden_layers": 4, "sliding_window": 8, "query_pre_attn_scalar": 20,
           "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
           "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                               "full_attention": {"rope_type": "default", "rope_theta": 100_000.0}}}
GEMMA2_WINDOW = 6
# one prompt of each text, plus the longest again with a tail: a shared prefix that must not be reused
EXTENDED = TEXTS[4] + " and then some more words at the end"
# how each checkpoint pools: (pooling, normalised)
POOLING = {"gemma": ("mean", False), "gemma2": ("last", True), "gemma3": ("mean", True),
           "gemma3-causal": ("last", True)}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    import transformers

    root = tmp_path_factory.mktemp("bidirectional-gemma")
    out: dict[str, Path] = {}
    # Gemma 1 saved whole (tied LM head, left unread); mean pooling, not normalised
    gemma = transformers.GemmaConfig(**_GEMMA, num_hidden_layers=2, tie_word_embeddings=True)
    out["gemma"] = _save(transformers.GemmaForCausalLM(gemma), root / "gemma", seed=11)
    _sentence_transformers(out["gemma"], "mean", normalize=False)
    # Gemma 2, bare: windows on alternate layers, the attention soft cap; no sentence-transformers
    # files, so the decoder embedder's default (last token, normalised)
    gemma2 = transformers.Gemma2Config(**_GEMMA, num_hidden_layers=4, sliding_window=GEMMA2_WINDOW,
                                       query_pre_attn_scalar=40, attn_logit_softcapping=4.0,
                                       final_logit_softcapping=8.0)
    out["gemma2"] = _save(transformers.Gemma2Model(gemma2), root / "gemma2", seed=12,
                          architectures=["Gemma2ForCausalLM"])
    # Gemma 3 as EmbeddingGemma: the bare Gemma3TextModel, mean pooling, normalised
    gemma3 = transformers.Gemma3TextConfig(**_GEMMA, **_GEMMA3)
    out["gemma3"] = _save(transformers.Gemma3TextModel(gemma3), root / "gemma3", seed=13,
                          architectures=["Gemma3ForCausalLM"])
    _sentence_transformers(out["gemma3"], "mean", normalize=True)
    # the same weights with the flag off: a causal Gemma 3 embedder, as before
    out["gemma3-causal"] = root / "gemma3-causal"
    shutil.copytree(out["gemma3"], out["gemma3-causal"],
                    ignore=shutil.ignore_patterns("modules.json", "1_Pooling", "2_Normalize"))
    config = out["gemma3-causal"] / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "use_bidirectional_attention": False}))
    for folder in out.values():
        _tokenizer(folder, "<s> $A", "<s> $A $B", type_ids=False)
    return out


def _ids(folder: Path, texts: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    return [tok(t)["input_ids"] for t in texts]


def _symmetric_mask(n: int, window: int | None) -> torch.Tensor:
    """An additive [1, 1, n, n] mask: every key seen, or those less than ``window`` away."""
    idx = torch.arange(n)
    hidden = (idx[:, None] - idx[None, :]).abs() >= window if window else torch.zeros(n, n, dtype=torch.bool)
    return torch.zeros(n, n).masked_fill(hidden, torch.finfo(torch.float32).min)[None, None]


@torch.no_grad()
def _transformers_vectors(name: str, folder: Path, ids: list[list[int]]) -> torch.Tensor:
    """transformers' last hidden states of each input alone, pooled as ``POOLING[name]`` says."""
    import transformers

    eager = name == "gemma2"
    model = transformers.AutoModel.from_pretrained(str(folder), dtype=torch.float32,
                                                   attn_implementation="eager" if eager else "sdpa").eval()
    rows = []
    for prompt in ids:
        kwargs = {}
        if eager:
            kwargs["attention_mask"] = {"full_attention": _symmetric_mask(len(prompt), None),
                                        "sliding_attention": _symmetric_mask(len(prompt), GEMMA2_WINDOW)}
        hidden = model(torch.tensor([prompt]), **kwargs).last_hidden_state[0]
        rows.append(hidden.mean(0) if POOLING[name][0] == "mean" else hidden[-1])
    vectors = torch.stack(rows)
    return torch.nn.functional.normalize(vectors, dim=-1) if POOLING[name][1] else vectors


def _assert_close(ours, reference: torch.Tensor) -> None:
    ours, reference = torch.as_tensor(ours).float(), reference.float()
    cosine = torch.nn.functional.cosine_similarity(ours, reference, dim=-1)
    assert float((1 - cosine).abs().max()) < 1e-5, cosine
    torch.testing.assert_close(ours, reference, atol=1e-5 * max(1.0, float(reference.abs().max())), rtol=1e-4)


def _embed(llm: LLM, prompts: list[list[int]]) -> list[list[float]]:
    outs = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    return [o.outputs.embedding for o in outs]


@pytest.mark.parametrize("name", ["gemma", "gemma2", "gemma3"])
def test_bidirectional_gemma_embeds_like_transformers_in_one_mixed_batch(name, folders):
    """Short and long inputs (past Gemma 2 / 3's windows) in one batch give transformers'
    bidirectional vectors, and each the same alone; an input extending another is not served from
    the shorter one's KV (a pooling input runs whole, without the cache)."""
    folder = folders[name]
    ids = _ids(folder, [*TEXTS, EXTENDED])
    assert max(map(len, ids)) > 3 * GEMMA2_WINDOW and min(map(len, ids)) < 4
    reference = _transformers_vectors(name, folder, ids)
    llm = LLM(model=str(folder), dtype="float32", runner="pooling")
    try:
        model = llm.llm_engine.core.executor.worker.runner.model
        assert model.attention_layers() == []  # no KV cache kept
        assert all(not layer.self_attn.attn.causal for layer in model.model.layers)
        _assert_close(_embed(llm, ids), reference)
        shortest = ids.index(min(ids, key=len))
        for i in (shortest, 4, len(ids) - 1):  # TEXTS[4] alone, then the input that extends it
            _assert_close(_embed(llm, [ids[i]]), reference[i:i + 1])
    finally:
        llm.shutdown()


def test_embeddinggemmas_shape_equals_sentence_transformers_encode(folders):
    """Gemma 3's sentence-transformers files (mean pooling, Normalize) are read, and the vectors
    equal ``SentenceTransformer.encode``'s (batched and padded: transformers' own bidirectional masks)."""
    from sentence_transformers import SentenceTransformer

    folder = folders["gemma3"]
    model = _load(folder)
    assert (model.pooler.pooling_type, model.pooler.config.normalize) == ("MEAN", True)
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [5, 5, None, 5]  # 8 // 2 + 1
    reference = SentenceTransformer(str(folder), device="cpu").encode(TEXTS, convert_to_tensor=True, batch_size=4)
    llm = LLM(model=str(folder), dtype="float32", runner="pooling")
    try:
        _assert_close([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)], reference)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("name", ["gemma", "gemma3"])
def test_the_generate_runner_refuses_a_bidirectional_gemma_naming_the_field(name, folders):
    from gridserve.services.worker.loader import load_model
    from gridserve.shared.config import GridserveConfig

    config = GridserveConfig.from_kwargs(model=str(folders[name]), dtype="float32").finalize()
    assert config.model.runner == "generate"
    with pytest.raises(ConfigError) as info:
        load_model(config, torch.device("cpu"))
    assert info.value.field == "model.hf_config.use_bidirectional_attention"
    assert "cannot generate" in info.value.message and "pooling" in info.value.message
    with pytest.raises(ConfigError, match="use_bidirectional_attention"):
        LLM(model=str(folders[name]), dtype="float32")  # the offline API: the start fails, naming it


def test_a_causal_gemma_embedder_still_pools_its_causal_last_token(folders):
    """The flag off: causal attention with a KV cache per layer (windows as the config sets them),
    transformers' causal last token, normalised; not the bidirectional model's vectors."""
    folder = folders["gemma3-causal"]
    model = _load(folder)
    layers = model.attention_layers()
    assert len(layers) == 4 and all(layer.causal for layer in layers)
    assert [layer.sliding_window for layer in layers] == [8, 8, None, 8]
    ids = _ids(folder, TEXTS)
    reference = _transformers_vectors("gemma3-causal", folder, ids)
    llm = LLM(model=str(folder), dtype="float32", runner="pooling")
    try:
        ours = _embed(llm, ids)
    finally:
        llm.shutdown()
    _assert_close(ours, reference)
    bidirectional = _transformers_vectors("gemma3-causal", folders["gemma3"], ids)  # same weights and pooling
    assert float((reference - bidirectional).abs().max()) > 1e-2
