"""Pooling models through ``gridserve.LLM`` (vLLM's ``embed`` / ``classify`` / ``score``): the engine
schedules each input whole, without KV blocks, and the worker pools it; the results equal
sentence-transformers' and transformers' on the same tiny checkpoints (test_pooling_models's)."""

from __future__ import annotations

import pytest
import torch

from gridserve import LLM, SamplingParams
from gridserve.shared.errors import InvalidArgumentError
from gridserve.shared.pooling import PoolingParams
from tests.integration.test_pooling_models import PAIRS, TEXTS, pooling_checkpoints

pytest.importorskip("sentence_transformers")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return pooling_checkpoints(tmp_path_factory.mktemp("pooling"))


def _assert_close(ours, reference, tol: float = 1e-5) -> None:
    ours, reference = torch.tensor(ours), torch.as_tensor(reference).float()
    cosine = torch.nn.functional.cosine_similarity(ours, reference, dim=-1)
    assert float((1 - cosine).abs().max()) < tol, cosine
    torch.testing.assert_close(ours, reference, atol=tol * max(1.0, float(reference.abs().max())), rtol=1e-4)


@pytest.mark.parametrize("name", ["bert", "xlmr", "qwen3"])
def test_embed_equals_sentence_transformers_in_one_mixed_batch(name, folders):
    from sentence_transformers import SentenceTransformer

    runner = {"runner": "pooling"} if name == "qwen3" else {}  # a generative config converted to an embedder
    llm = LLM(model=str(folders[name]), dtype="float32", **runner)
    try:
        outs = llm.embed(TEXTS, use_tqdm=False)
        reference = SentenceTransformer(str(folders[name]), device="cpu").encode(TEXTS, convert_to_tensor=True)
        _assert_close([o.outputs.embedding for o in outs], reference)
        alone = [llm.embed([t], use_tqdm=False)[0].outputs.embedding for t in TEXTS[:3]]
        _assert_close(alone, reference[:3])
    finally:
        llm.shutdown()


def test_cross_encoder_scores_equal_cross_encoder_predict_and_classify_equals_transformers(folders):
    from sentence_transformers import CrossEncoder
    from transformers import AutoTokenizer, BertForSequenceClassification

    llm = LLM(model=str(folders["xlmr-reranker"]), dtype="float32")
    try:
        scores = [o.outputs.score for o in llm.score([a for a, _ in PAIRS], [b for _, b in PAIRS], use_tqdm=False)]
        predicted = CrossEncoder(str(folders["xlmr-reranker"]), device="cpu").predict(PAIRS)
        torch.testing.assert_close(torch.tensor(scores), torch.as_tensor(predicted).float(), atol=1e-5, rtol=1e-5)
        one_to_many = llm.score(PAIRS[0][0], [b for _, b in PAIRS], use_tqdm=False)
        assert len(one_to_many) == len(PAIRS)
        with pytest.raises(InvalidArgumentError, match="pooling_params.task"):
            llm.embed(["x"], use_tqdm=False)  # a cross-encoder scores pairs, it embeds nothing
        with pytest.raises(InvalidArgumentError, match="sampling_params"):
            llm.generate(["hi"], SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        llm.shutdown()

    folder = folders["bert-classifier"]
    llm = LLM(model=str(folder), dtype="float32")
    try:
        probs = [o.outputs.probs for o in llm.classify(TEXTS, use_tqdm=False)]
        tok = AutoTokenizer.from_pretrained(str(folder))
        hf = BertForSequenceClassification.from_pretrained(str(folder)).eval()
        with torch.no_grad():
            expected = [hf(**tok(t, return_tensors="pt")).logits[0].softmax(-1) for t in TEXTS]
        torch.testing.assert_close(torch.tensor(probs), torch.stack(expected), atol=1e-5, rtol=1e-5)
        with pytest.raises(InvalidArgumentError, match="scores no pairs"):
            llm.score("a", "b", use_tqdm=False)  # three labels: a classifier, not a cross-encoder
    finally:
        llm.shutdown()


def test_limits_and_the_other_runner_are_refused_naming_the_field(folders, llama_tiny):
    llm = LLM(model=str(folders["bert"]), dtype="float32")
    try:
        limit = llm.config.max_model_len
        with pytest.raises(InvalidArgumentError, match="prompt_token_ids"):
            llm.embed([{"prompt_token_ids": [5] * (limit + 1)}], use_tqdm=False)
        kept = llm.embed([{"prompt_token_ids": [5] * (limit + 1)}], truncate_prompt_tokens=limit, use_tqdm=False)
        assert len(kept[0].prompt_token_ids) == limit
        with pytest.raises(InvalidArgumentError, match="prompt_token_ids"):
            llm.embed([{"prompt_token_ids": []}], use_tqdm=False)
        with pytest.raises(InvalidArgumentError, match="prompt_token_ids"):
            llm.embed([{"prompt_token_ids": [10**7]}], use_tqdm=False)
        with pytest.raises(InvalidArgumentError, match="pooling_params.dimensions"):
            llm.embed(["x"], PoolingParams(dimensions=8), use_tqdm=False)  # no Matryoshka support
    finally:
        llm.shutdown()
    gen = LLM(model=str(llama_tiny), kv_cache_memory_bytes=4 << 20)
    try:
        with pytest.raises(InvalidArgumentError, match="model"):
            gen.embed(["hi"], use_tqdm=False)
    finally:
        gen.shutdown()


def test_tensor_parallel_2_worker_processes_give_the_single_workers_embeddings(folders):
    single = LLM(model=str(folders["bert"]), dtype="float32")
    try:
        expected = [o.outputs.embedding for o in single.embed(TEXTS, use_tqdm=False)]
    finally:
        single.shutdown()
    llm = LLM(model=str(folders["bert"]), dtype="float32", tensor_parallel_size=2)
    try:
        _assert_close([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)], expected)
    finally:
        llm.shutdown()
