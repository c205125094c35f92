"""Pooling models (issue 37, the worker's part) equal sentence-transformers and transformers on tiny
random checkpoints built here with transformers' own classes.

Each folder is a sentence-transformers model as the hub holds them (the Transformer's files at the
root, ``modules.json``, ``1_Pooling/config.json``, a ``2_Normalize`` module when normalised) with a
tokenizer whose template adds the specials (BERT's ``[CLS] a [SEP] b [SEP]`` with type ids 0 / 1;
RoBERTa's ``<s> a </s></s> b </s>``; Qwen3-Embedding's EOS at the end). gridserve's loader builds
each model in process; inputs are packed without padding (``run_pooling``). Checked: mean (BERT),
CLS (XLM-R) and last-token (Qwen3 as an embedder) pooling against ``SentenceTransformer.encode``;
the cross-encoders' logits against transformers' ``*ForSequenceClassification`` and their sigmoid
against ``CrossEncoder.predict``; a packed batch of short and long inputs against one input at a
time; BERT's token type ids; tensor parallelism (two ranks in two threads).
"""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from gridserve.demo import recipe
from gridserve.services.worker.loader import load_model
from gridserve.services.worker.parallel_state import ParallelState, set_parallel_state
from gridserve.services.worker.pooler import run_pooling
from gridserve.shared.config import GridserveConfig
from gridserve.shared.errors import ConfigError, InvalidArgumentError
from gridserve.shared.model_registry import resolve_runner
from gridserve.shared.parallel import RankLayout
from gridserve.shared.pooling import PoolingParams
from tests.zoo import VOCAB

from .test_zoo_split import ThreadRank, _Exchange

HIDDEN = 64
_ENCODER = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 128, "hidden_act": "gelu", "bos_token_id": recipe.BOS_ID,
            "eos_token_id": recipe.EOS_ID, "pad_token_id": recipe.PAD_ID}
TEXTS = ["hi", "def main(argv):", "import os, sys\nfor path in sys.path:\n    print(os.path.abspath(path))",
         "x" * 3, " ".join(["return self._value + other"] * 12), "class A:\n    pass"]
PAIRS = [("what is a list", "a list is a mutable sequence"), ("hi", "import os"),
         ("def f(x):", " ".join(["return x * 2"] * 10)), ("a", "b")]
ST = "sentence_transformers.models."  # the legacy module type names most hub models still carry


# ---------------------------------------------------------------------------------------------
# checkpoints


def _spread(model: torch.nn.Module, seed: int) -> None:
    """Weights that make every layer matter (transformers' init leaves attention nearly uniform):
    linear weights ~ N(0, 1.3 / fan_in), tables ~ N(0, 1), norm weights 1 +- 0.1, biases +- 0.1."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.dim() == 2:
                p.copy_(noise if "embed" in name else noise * (1.3 / math.sqrt(p.shape[1])))
            elif name.endswith("bias"):
                p.copy_(noise * 0.1)
            else:  # LayerNorm / RMSNorm weights
                p.copy_(1.0 + 0.1 * noise)


def _tokenizer(folder: Path, single: str, pair: str, type_ids: bool) -> None:
    """The zoo's BPE tokenizer with a template adding ``<s>`` (id 1) / ``</s>`` (id 2)."""
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_file(str(recipe.ensure_tokenizer(VOCAB) / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[("<s>", recipe.BOS_ID), ("</s>", recipe.EOS_ID)])
    names = ["input_ids", "token_type_ids", "attention_mask"] if type_ids else ["input_ids", "attention_mask"]
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>", cls_token="<s>", sep_token="</s>",
                            model_input_names=names).save_pretrained(str(folder))


def _sentence_transformers(folder: Path, pooling: str, normalize: bool, legacy: bool = True) -> None:
    """``modules.json`` and its modules' folders: the legacy ``pooling_mode_*`` keys or the
    current ``pooling_mode``."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": f"{ST}Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": f"{ST}Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": f"{ST}Normalize"})
        (folder / "2_Normalize").mkdir()
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    legacy_key = {"mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token", "lasttoken": "pooling_mode_lasttoken"}
    config = ({"word_embedding_dimension": HIDDEN, legacy_key[pooling]: True} if legacy
              else {"embedding_dimension": HIDDEN, "pooling_mode": pooling, "include_prompt": True})
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(config))
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128, "do_lower_case": False}))


def _save(model, folder: Path, seed: int, architectures: list[str] | None = None) -> Path:
    _spread(model, seed)
    model.eval().save_pretrained(str(folder))
    if architectures:
        path = folder / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "architectures": architectures}))
    return folder


BERT_TEMPLATE = ("<s> $A </s>", "<s> $A </s> $B:1 </s>:1")
ROBERTA_TEMPLATE = ("<s> $A </s>", "<s> $A </s> </s> $B </s>")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    return pooling_checkpoints(tmp_path_factory.mktemp("pooling"))


def pooling_checkpoints(root: Path) -> dict[str, Path]:
    """The tiny pooling checkpoints (tokenizer and sentence-transformers files included) under ``root``."""
    import transformers

    out: dict[str, Path] = {}
    bert = transformers.BertConfig(**_ENCODER, max_position_embeddings=128, type_vocab_size=2)

    # BERT embedder: mean pooling, normalised (all-MiniLM's shape)
    out["bert"] = _save(transformers.BertModel(bert), root / "bert", seed=1)
    _tokenizer(out["bert"], *BERT_TEMPLATE, type_ids=True)
    _sentence_transformers(out["bert"], "mean", normalize=True)

    # BERT cross-encoder with three labels: pairs carry token type ids
    classifier = transformers.BertConfig(**_ENCODER, max_position_embeddings=128, type_vocab_size=2, num_labels=3)
    out["bert-classifier"] = _save(transformers.BertForSequenceClassification(classifier), root / "bert-cls", seed=2)
    _tokenizer(out["bert-classifier"], *BERT_TEMPLATE, type_ids=True)

    # XLM-R: padding_idx 3 (positions from 4), one token type; an embedder (CLS, not normalised,
    # sentence-transformers 5's config keys) and a one-label cross-encoder (bge-reranker's shape)
    xlmr = {**_ENCODER, "max_position_embeddings": 128 + recipe.PAD_ID + 1, "type_vocab_size": 1}
    out["xlmr"] = _save(transformers.XLMRobertaModel(transformers.XLMRobertaConfig(**xlmr)), root / "xlmr", seed=3)
    _tokenizer(out["xlmr"], *ROBERTA_TEMPLATE, type_ids=False)
    _sentence_transformers(out["xlmr"], "cls", normalize=False, legacy=False)
    reranker = transformers.XLMRobertaConfig(**xlmr, num_labels=1)
    out["xlmr-reranker"] = _save(transformers.XLMRobertaForSequenceClassification(reranker), root / "rerank", seed=4)
    _tokenizer(out["xlmr-reranker"], *ROBERTA_TEMPLATE, type_ids=False)

    # Qwen3-Embedding's shape: the bare Qwen3Model saved (no ``model.`` prefix, no LM head),
    # config.json naming Qwen3ForCausalLM, EOS appended, last-token pooling, normalised
    qwen3 = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                     max_position_embeddings=256, tie_word_embeddings=True,
                                     bos_token_id=recipe.BOS_ID, eos_token_id=recipe.EOS_ID,
                                     pad_token_id=recipe.PAD_ID)
    out["qwen3"] = _save(transformers.Qwen3Model(qwen3), root / "qwen3", seed=5, architectures=["Qwen3ForCausalLM"])
    _tokenizer(out["qwen3"], "$A </s>", "$A </s> $B </s>", type_ids=False)
    _sentence_transformers(out["qwen3"], "lasttoken", normalize=True)
    return out


def _load(path: Path, state: ParallelState | None = None, **engine) -> torch.nn.Module:
    """The model as gridserve's loader builds it under the pooling runner (a generative checkpoint
    converted to an embedder: ``config.model.convert`` "embed")."""
    config = GridserveConfig.from_kwargs(model=str(path), dtype="float32", runner="pooling", **engine).finalize()
    set_parallel_state(state or ParallelState.single())
    try:
        return load_model(config, torch.device("cpu"))
    finally:
        set_parallel_state(ParallelState.single())


def _close(ours: torch.Tensor, reference: torch.Tensor, normalized: bool) -> None:
    reference = reference.float()
    cosine = torch.nn.functional.cosine_similarity(ours, reference, dim=-1)
    assert float((1 - cosine).abs().max()) < 1e-5, cosine
    atol = 1e-5 if normalized else 1e-5 * float(reference.abs().max())
    torch.testing.assert_close(ours, reference, atol=atol, rtol=1e-5)


def _embed_like_st(folder: Path, model, texts=TEXTS, **params):
    """(gridserve's embeddings, SentenceTransformer(folder).encode's, the token ids, whether it normalises)."""
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(folder), device="cpu")
    normalize = any(type(m).__name__ == "Normalize" for m in st)
    reference = st.encode(texts, convert_to_tensor=True, batch_size=4)
    ids = [st.tokenizer(t)["input_ids"] for t in texts]
    assert max(map(len, ids)) > 30 and min(map(len, ids)) < 5, "the inputs must mix short and long"
    ours = torch.stack(run_pooling(model, ids, [PoolingParams(**params)] * len(ids)))
    return ours, reference, ids, normalize


# ---------------------------------------------------------------------------------------------
# embeddings


@pytest.mark.parametrize("name", ["bert", "xlmr", "qwen3"])
def test_embeddings_equal_sentence_transformers(name, folders):
    """Mean (BERT, normalised), CLS (XLM-R's positions from padding_idx + 1, raw) and last-token
    (Qwen3 as Qwen3-Embedding, normalised) pooling, read from the folder's sentence-transformers files."""
    model = _load(folders[name])
    expected_type = {"bert": "MEAN", "xlmr": "CLS", "qwen3": "LAST"}[name]
    assert model.pooler.pooling_type == expected_type and model.is_pooling_model
    ours, reference, ids, normalize = _embed_like_st(folders[name], model)
    assert model.pooler.config.normalize is normalize
    _close(ours, reference, normalize)
    if normalize:
        assert torch.allclose(ours.norm(dim=-1), torch.ones(len(ids)), atol=1e-6)


@pytest.mark.parametrize("name", ["bert", "qwen3"])
def test_a_packed_batch_of_short_and_long_inputs_gives_each_inputs_own_vector(name, folders):
    model = _load(folders[name])
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folders[name]))
    ids = [tok(t)["input_ids"] for t in TEXTS]
    params = PoolingParams()
    batch = run_pooling(model, ids, [params] * len(ids))
    for i, prompt in enumerate(ids):
        alone = run_pooling(model, [prompt], [params])[0]
        torch.testing.assert_close(batch[i], alone, atol=1e-6, rtol=1e-6)
    # the same inputs in another order: the same vectors
    order = list(reversed(range(len(ids))))
    shuffled = run_pooling(model, [ids[i] for i in order], [params] * len(ids))
    for j, i in enumerate(order):
        torch.testing.assert_close(shuffled[j], batch[i], atol=1e-6, rtol=1e-6)


def test_per_request_normalize_and_matryoshka_dimensions(folders, tmp_path):
    """``normalize=False`` gives the raw mean; ``dimensions`` truncates then normalises, refused
    (naming the field) for a model whose config does not declare Matryoshka support."""
    model = _load(folders["bert"])
    from transformers import AutoTokenizer

    ids = [AutoTokenizer.from_pretrained(str(folders["bert"]))(t)["input_ids"] for t in TEXTS[:3]]
    raw = run_pooling(model, ids, [PoolingParams(normalize=False)] * 3)
    mixed = run_pooling(model, ids, [PoolingParams(), PoolingParams(normalize=False), PoolingParams(dimensions=16)])
    torch.testing.assert_close(mixed[0], torch.nn.functional.normalize(raw[0], dim=-1))
    torch.testing.assert_close(mixed[1], raw[1])
    assert mixed[2].shape == (16,)
    torch.testing.assert_close(mixed[2], torch.nn.functional.normalize(raw[2][:16], dim=-1))

    hf_config = model_hf_config(folders["bert"])
    with pytest.raises(InvalidArgumentError) as info:
        PoolingParams(dimensions=16).verify(model.supported_tasks, HIDDEN, hf_config)
    assert info.value.field == "pooling_params.dimensions" and "Matryoshka" in info.value.message
    matryoshka = {**hf_config, "matryoshka_dimensions": [16, 32, 64]}
    PoolingParams(dimensions=32).verify(model.supported_tasks, HIDDEN, matryoshka)
    for bad in (24, 128):
        with pytest.raises(InvalidArgumentError, match="dimensions"):
            PoolingParams(dimensions=bad).verify(model.supported_tasks, HIDDEN, matryoshka)


def model_hf_config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def test_without_sentence_transformers_files_bert_pools_cls_normalised(folders, tmp_path):
    """vLLM's default for a BERT embedder: the [CLS] row, normalised (here equal to transformers'
    last_hidden_state[:, 0] normalised)."""
    import shutil

    import transformers

    folder = tmp_path / "plain-bert"
    shutil.copytree(folders["bert"], folder, ignore=shutil.ignore_patterns("modules.json", "1_Pooling", "2_Normalize"))
    model = _load(folder)
    assert (model.pooler.pooling_type, model.pooler.config.normalize) == ("CLS", True)
    hf = transformers.BertModel.from_pretrained(str(folder)).eval()
    ids = [[1, 50, 60, 70, 2], [1, 9, 2]]
    ours = run_pooling(model, ids, [PoolingParams()] * 2)
    for prompt, vector in zip(ids, ours):
        with torch.no_grad():
            cls = hf(torch.tensor([prompt])).last_hidden_state[0, 0]
        torch.testing.assert_close(vector, torch.nn.functional.normalize(cls, dim=-1), atol=1e-6, rtol=1e-5)


def test_a_generative_checkpoint_converted_to_an_embedder_reads_no_lm_head():
    """The zoo's Qwen3ForCausalLM (untied LM head, ``model.`` names) under the pooling runner: its
    LM head is left unread and the vector is transformers' last hidden state of the last token,
    normalised (no sentence-transformers files: the decoder embedder's default)."""
    import transformers

    from .test_zoo_llama_family import checkpoint as llama_family

    path = Path(llama_family("qwen3"))
    model = _load(path)
    assert type(model).__name__ == "Qwen3ForEmbedding" and not hasattr(model, "lm_head")
    assert "lm_head.weight" not in model.load_report.read
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = [[5, 77, 300, 1200, 9], list(range(100, 160)), [42]]
    ours = run_pooling(model, ids, [PoolingParams()] * len(ids))
    for prompt, vector in zip(ids, ours):
        with torch.no_grad():
            last = hf.model(torch.tensor([prompt])).last_hidden_state[0, -1]
        torch.testing.assert_close(vector, torch.nn.functional.normalize(last, dim=-1), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# cross-encoders


def _pairs(folder: Path) -> tuple[list[list[int]], list[list[int]] | None, dict]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    encoded = [tok(a, b) for a, b in PAIRS]
    types = [e["token_type_ids"] for e in encoded] if "token_type_ids" in encoded[0] else None
    return [e["input_ids"] for e in encoded], types, tok


def _hf_logits(cls_name: str, folder: Path, ids: list[list[int]], types) -> torch.Tensor:
    import transformers

    hf = getattr(transformers, cls_name).from_pretrained(str(folder)).eval()
    rows = []
    with torch.no_grad():
        for i, prompt in enumerate(ids):
            kwargs = {"token_type_ids": torch.tensor([types[i]])} if types else {}
            rows.append(hf(torch.tensor([prompt]), **kwargs).logits[0])
    return torch.stack(rows)


def test_xlmr_cross_encoder_logits_equal_transformers_and_scores_equal_cross_encoder(folders):
    from sentence_transformers import CrossEncoder

    folder = folders["xlmr-reranker"]
    model = _load(folder)
    assert model.supported_tasks == ("classify", "score") and model.pooler.activation == "sigmoid"
    ids, types, _ = _pairs(folder)
    assert types is None and ids[2].count(recipe.EOS_ID) == 3  # <s> a </s></s> b </s>
    logits = torch.stack(run_pooling(model, ids, [PoolingParams(task="score", activation=False)] * len(ids)))
    reference = _hf_logits("XLMRobertaForSequenceClassification", folder, ids, None)
    assert logits.shape == (len(PAIRS), 1)
    torch.testing.assert_close(logits, reference, atol=1e-5, rtol=1e-5)

    scores = torch.stack(run_pooling(model, ids, [PoolingParams(task="score")] * len(ids)))[:, 0]
    predicted = torch.as_tensor(CrossEncoder(str(folder), device="cpu").predict(PAIRS)).float()
    torch.testing.assert_close(scores, predicted, atol=1e-5, rtol=1e-5)
    assert float(scores.max() - scores.min()) > 1e-3, "the pairs' scores must differ"


def test_bert_classifier_honours_token_type_ids(folders):
    """BERT's pairs: segment B has type 1. The logits equal transformers' (pooler + classifier),
    differ when the type ids are dropped, and the default activation of three labels is softmax."""
    folder = folders["bert-classifier"]
    model = _load(folder)
    ids, types, _ = _pairs(folder)
    assert types is not None and any(1 in t for t in types)
    raw = [PoolingParams(task="classify", activation=False)] * len(ids)
    logits = torch.stack(run_pooling(model, ids, raw, token_type_ids=types))
    torch.testing.assert_close(logits, _hf_logits("BertForSequenceClassification", folder, ids, types),
                               atol=1e-5, rtol=1e-5)
    without = torch.stack(run_pooling(model, ids, raw))
    assert float((without - logits).abs().max()) > 1e-3, "token type ids made no difference"
    probs = torch.stack(run_pooling(model, ids, [PoolingParams(task="classify")] * len(ids), token_type_ids=types))
    torch.testing.assert_close(probs, torch.softmax(logits, -1))
    with pytest.raises(InvalidArgumentError) as info:
        run_pooling(model, ids[:1], [PoolingParams(task="embed")])
    assert info.value.field == "pooling_params.task"


# ---------------------------------------------------------------------------------------------
# registry, runner, tensor parallelism


def test_an_encoder_attends_without_a_kv_cache_and_has_no_lm_head(folders):
    model = _load(folders["xlmr"])
    assert model.attention_layers() == []
    assert all(not m.causal for m in model.modules() if type(m).__name__ == "PagedAttention")
    with pytest.raises(RuntimeError, match="pooling model"):
        model.compute_logits(torch.zeros(1, HIDDEN))
    assert model.max_input_tokens == 128  # max_position_embeddings less padding_idx + 1


def test_the_runner_a_model_gets():
    assert resolve_runner("BertModel").runner == "pooling"
    assert resolve_runner("XLMRobertaForSequenceClassification").tasks == ("classify", "score")
    assert resolve_runner("Qwen3ForCausalLM").runner == "generate"
    converted = resolve_runner("Qwen3ForCausalLM", "pooling")
    assert (converted.convert, converted.tasks) == ("embed", ("embed",))
    with pytest.raises(ConfigError) as info:
        resolve_runner("BertModel", "generate")
    assert info.value.field == "model.runner" and "pooling" in info.value.message
    with pytest.raises(ConfigError) as info:
        resolve_runner("Qwen3ForCausalLM", "pooling", "none")
    assert info.value.field == "model.convert"



@pytest.mark.parametrize(("name", "params"), [("bert", PoolingParams()),
                                            ("xlmr-reranker", PoolingParams(task="score", activation=False))])
def test_tensor_parallel_2_gives_the_single_models_vectors(name, params, folders):
    """Heads and the MLP split over two ranks (threads whose all-reduces meet), the token table
    vocab-parallel: both ranks pool the single model's vectors and scores."""
    from transformers import AutoTokenizer

    folder = folders[name]
    tok = AutoTokenizer.from_pretrained(str(folder))
    ids = [tok(t)["input_ids"] for t in TEXTS]
    single = run_pooling(_load(folder), ids, [params] * len(ids))
    exchange = _Exchange(2)
    ranks = [_load(folder, state=ThreadRank(RankLayout(rank, 2, 1), exchange=exchange), tensor_parallel_size=2)
             for rank in (0, 1)]
    assert ranks[0].model.layers[0].attention.num_heads == 2
    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda m: run_pooling(m, ids, [params] * len(ids)), ranks))
    for out in outs:
        for a, b in zip(out, single):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
