"""EmbeddingGemma's checkpoint shape (issue 37): ``config.json`` naming ``Gemma3TextModel``, the bare
Gemma 3 text model's weights, bidirectional attention, and a sentence-transformers pipeline of
Transformer, Pooling (mean), two ``Dense`` modules and Normalize, saved here by sentence-transformers
itself from a tiny random model. ``LLM(...).embed`` gives ``SentenceTransformer.encode``'s vectors,
with and without Matryoshka ``dimensions`` (sentence-transformers truncates the Dense modules'
output, then normalises: ``encode(truncate_dim=d, normalize_embeddings=True)``). Also: the runner
the architecture gets, tensor parallelism (the Dense layers replicated), a Dense module whose weights
are a pickle only, and BERT with a Dense module.
"""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from gridserve import LLM
from gridserve.services.worker.pooler import run_pooling
from gridserve.shared.errors import ConfigError, InvalidArgumentError
from gridserve.shared.parallel import RankLayout
from gridserve.shared.pooling import PoolingParams, embedding_size

from .test_bidirectional_gemma_embedders import _GEMMA, _GEMMA3
from .test_pooling_models import _ENCODER, BERT_TEMPLATE, HIDDEN, TEXTS, _load, _save, _tokenizer
from .test_zoo_split import ThreadRank, _Exchange

pytest.importorskip("sentence_transformers")

PROJECTED = 160  # EmbeddingGemma's projection widens the pooled vector (768 -> 3072), then narrows it
MATRYOSHKA = [64, 32, 16]


def _st_folder(base: Path, folder: Path, *modules) -> Path:
    """``base`` (a transformers model folder with its tokenizer) saved by sentence-transformers with
    Transformer, then ``modules``; the Dense layers' random weights seeded."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Transformer

    SentenceTransformer(modules=[Transformer(str(base)), *modules], device="cpu").save(str(folder))
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    import transformers
    from sentence_transformers.sentence_transformer.modules import Dense, Normalize, Pooling

    root = tmp_path_factory.mktemp("embeddinggemma")
    out: dict[str, Path] = {}
    config = transformers.Gemma3TextConfig(**_GEMMA, **_GEMMA3, matryoshka_dimensions=MATRYOSHKA)
    base = _save(transformers.Gemma3TextModel(config), root / "gemma3-base", seed=21)
    _tokenizer(base, "<s> $A", "<s> $A $B", type_ids=False)
    torch.manual_seed(22)
    out["gemma3"] = _st_folder(base, root / "embeddinggemma", Pooling(HIDDEN, "mean"),
                               Dense(HIDDEN, PROJECTED, bias=True, activation_function=torch.nn.Tanh()),
                               Dense(PROJECTED, HIDDEN, bias=False, activation_function=torch.nn.Identity()),
                               Normalize())
    bert = transformers.BertConfig(**_ENCODER, max_position_embeddings=128, type_vocab_size=2)
    base = _save(transformers.BertModel(bert), root / "bert-base", seed=23)
    _tokenizer(base, *BERT_TEMPLATE, type_ids=True)
    torch.manual_seed(24)
    out["bert"] = _st_folder(base, root / "bert-dense", Pooling(HIDDEN, "cls"), Dense(HIDDEN, 32))
    return out


def _assert_close(ours, reference: torch.Tensor) -> None:
    ours, reference = torch.as_tensor(ours).float(), torch.as_tensor(reference).float()
    assert ours.shape == reference.shape
    cosine = torch.nn.functional.cosine_similarity(ours, reference, dim=-1)
    assert float((1 - cosine).abs().max()) < 1e-5, cosine
    torch.testing.assert_close(ours, reference, atol=1e-5 * max(1.0, float(reference.abs().max())), rtol=1e-4)


def _encode(folder: Path, texts: list[str], dimensions: int | None = None) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(folder), device="cpu")
    if dimensions is None:
        return st.encode(texts, convert_to_tensor=True, batch_size=4)
    return st.encode(texts, convert_to_tensor=True, batch_size=4, truncate_dim=dimensions, normalize_embeddings=True)


def test_the_checkpoint_is_embeddinggemmas_shape(folders):
    import json

    folder = folders["gemma3"]
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["Gemma3TextModel"] and config["use_bidirectional_attention"] is True
    modules = [m["type"].rsplit(".", 1)[-1] for m in json.loads((folder / "modules.json").read_text())]
    assert modules == ["Transformer", "Pooling", "Dense", "Dense", "Normalize"]
    assert (folder / "2_Dense" / "model.safetensors").is_file() and (folder / "3_Dense" / "model.safetensors").is_file()


@pytest.mark.parametrize("runner", ["pooling", "auto"])
def test_embeddinggemma_embeds_like_sentence_transformers_with_and_without_dimensions(runner, folders):
    folder = folders["gemma3"]
    llm = LLM(model=str(folder), dtype="float32", **({"runner": runner} if runner != "auto" else {}))
    try:
        assert (llm.config.model.runner, llm.config.model.convert, llm.config.pooling_tasks) == \
            ("pooling", "none", ("embed",))
        model = llm.llm_engine.core.executor.worker.runner.model
        assert type(model).__name__ == "Gemma3TextModel" and model.attention_layers() == []
        assert [len(layer.linear.weight) for layer in model.sentence_dense.layers] == [PROJECTED, HIDDEN]
        _assert_close([o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)], _encode(folder, TEXTS))
        for dimensions in (32, 16):
            outs = llm.embed(TEXTS, PoolingParams(dimensions=dimensions), use_tqdm=False)
            _assert_close([o.outputs.embedding for o in outs], _encode(folder, TEXTS, dimensions))
    finally:
        llm.shutdown()


def test_embeddinggemma_refuses_to_generate_naming_the_runner(folders):
    folder = str(folders["gemma3"])
    with pytest.raises(ConfigError) as info:
        LLM(model=folder, dtype="float32", runner="generate")
    assert info.value.field == "model.runner" and "pooling" in info.value.message
    llm = LLM(model=folder, dtype="float32")
    try:
        with pytest.raises(InvalidArgumentError) as refused:
            llm.generate(["hi"], use_tqdm=False)
        assert refused.value.field == "sampling_params" and "pooling model" in refused.value.message
    finally:
        llm.shutdown()


def test_tensor_parallel_2_replicates_the_dense_layers_and_gives_the_single_models_vectors(folders):
    from transformers import AutoTokenizer

    folder = folders["gemma3"]
    ids = [AutoTokenizer.from_pretrained(str(folder))(t)["input_ids"] for t in TEXTS]
    params = [PoolingParams()] * len(ids)
    single = run_pooling(_load(folder), ids, params)
    exchange = _Exchange(2)
    ranks = [_load(folder, state=ThreadRank(RankLayout(rank, 2, 1), exchange=exchange), tensor_parallel_size=2)
             for rank in (0, 1)]
    assert ranks[0].model.layers[0].self_attn.attn.num_heads == 2
    for model in ranks:
        assert model.sentence_dense.layers[0].linear.weight.shape == (PROJECTED, HIDDEN)
    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda m: run_pooling(m, ids, params), ranks))
    for out in outs:
        for a, b in zip(out, single):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_a_dense_module_whose_weights_are_a_pickle_only_is_refused_naming_the_file(folders, tmp_path):
    from safetensors.torch import load_file

    folder = tmp_path / "pickled"
    shutil.copytree(folders["gemma3"], folder)
    dense = folder / "3_Dense"
    torch.save(load_file(str(dense / "model.safetensors")), dense / "pytorch_model.bin")
    (dense / "model.safetensors").unlink()
    with pytest.raises(ConfigError) as info:
        _load(folder)
    assert info.value.field == "3_Dense/pytorch_model.bin"
    assert "model.safetensors" in info.value.message and "pickle" in info.value.message
    with pytest.raises(ConfigError, match="pytorch_model.bin"):
        LLM(model=str(folder), dtype="float32")


def test_bert_with_a_dense_module_embeds_like_sentence_transformers(folders):
    """Any embedder takes Dense modules: BERT's CLS row through Dense(64 -> 32, tanh), unnormalised."""
    from transformers import AutoTokenizer

    folder = folders["bert"]
    assert embedding_size(folder, HIDDEN) == 32
    model = _load(folder)
    ids = [AutoTokenizer.from_pretrained(str(folder))(t)["input_ids"] for t in TEXTS]
    ours = torch.stack(run_pooling(model, ids, [PoolingParams()] * len(ids)))
    assert ours.shape == (len(TEXTS), 32)
    _assert_close(ours, _encode(folder, TEXTS))
