"""The pooler (``services/worker/pooler.py``), the pooling settings (``shared/pooling.py``) and the
no-cache attention's non-causal option, on hand-made tensors and folders."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from gridserve.services.worker.attention import AttentionMetadata, PagedAttention
from gridserve.services.worker.pooler import (
    ChunkedPool,
    ClassifierPooler,
    EmbeddingPooler,
    PoolingMetadata,
    pool_hidden,
)
from gridserve.shared.errors import ConfigError, InvalidArgumentError
from gridserve.shared.pooling import (
    PoolerConfig,
    PoolingParams,
    classifier_activation,
    matryoshka_dimensions,
    read_sentence_transformers_config,
    resolve_pooler_config,
)

LENS = [3, 1, 5]
QSL = torch.tensor([0, 3, 4, 9], dtype=torch.int32)


def _hidden(dim: int = 8) -> torch.Tensor:
    return torch.randn(sum(LENS), dim, generator=torch.Generator().manual_seed(0))


def test_pool_hidden_reduces_each_packed_sequence():
    h = _hidden()
    rows = list(h.split(LENS))
    torch.testing.assert_close(pool_hidden(h, QSL, "LAST"), torch.stack([r[-1] for r in rows]))
    torch.testing.assert_close(pool_hidden(h, QSL, "CLS"), torch.stack([r[0] for r in rows]))
    torch.testing.assert_close(pool_hidden(h, QSL, "MEAN"), torch.stack([r.mean(0) for r in rows]))
    assert pool_hidden(h.to(torch.bfloat16), QSL, "MEAN").dtype == torch.float32
    with pytest.raises(ValueError, match="at least one token"):
        pool_hidden(h, torch.tensor([0, 3, 3, 9]), "MEAN")


def test_embedding_pooler_applies_each_requests_dimensions_and_normalize():
    h = _hidden()
    pooler = EmbeddingPooler(PoolerConfig(pooling_type="MEAN", normalize=True))
    mean = pool_hidden(h, QSL, "MEAN")
    out = pooler(h, PoolingMetadata(QSL, [PoolingParams(), PoolingParams(normalize=False), PoolingParams(dimensions=4)]))
    torch.testing.assert_close(out[0], F.normalize(mean[0], dim=-1))
    torch.testing.assert_close(out[1], mean[1])
    torch.testing.assert_close(out[2], F.normalize(mean[2, :4], dim=-1))  # truncated, then normalised
    same = pooler(h, PoolingMetadata(QSL, [PoolingParams()] * 3))
    torch.testing.assert_close(torch.stack(same), F.normalize(mean, dim=-1))
    with pytest.raises(InvalidArgumentError) as info:
        pooler(h, PoolingMetadata(QSL, [PoolingParams(task="score")] * 3))
    assert info.value.field == "pooling_params.task"


def test_classifier_pooler_activations():
    h = _hidden()
    head = torch.nn.Linear(8, 3)
    logits = head(pool_hidden(h, QSL, "CLS")).detach()
    for activation, fn in (("softmax", lambda x: x.softmax(-1)), ("sigmoid", torch.sigmoid), ("none", lambda x: x)):
        pooler = ClassifierPooler("CLS", head, activation, 3)
        out = pooler(h, PoolingMetadata(QSL, [PoolingParams(task="classify"), PoolingParams(task="classify", activation=False),
                                              PoolingParams(task="classify")]))
        torch.testing.assert_close(out[0], fn(logits[0]))
        torch.testing.assert_close(out[1], logits[1])  # activation off: the raw logits
    assert pooler.supported_tasks == ("classify",)  # score: one label only
    with pytest.raises(InvalidArgumentError, match="score"):
        pooler(h, PoolingMetadata(QSL, [PoolingParams(task="score")] * 3))
    one = ClassifierPooler("CLS", lambda rows: head(rows)[:, :1], "sigmoid", 1)
    scores = one(h, PoolingMetadata(QSL, [PoolingParams(task="score")] * 3))
    torch.testing.assert_close(torch.stack(scores), torch.sigmoid(logits[:, :1]))


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
def test_pooling_over_chunks_equals_pooling_the_whole_sequence(pooling_type):
    h = _hidden()
    rows = h[:5]
    state = ChunkedPool(pooling_type)
    for chunk in rows.split([2, 0, 2, 1]):
        state.add(chunk)
    whole = pool_hidden(rows, torch.tensor([0, 5]), pooling_type)[0]
    torch.testing.assert_close(state.result(), whole.float() if pooling_type == "MEAN" else whole)
    pooler = EmbeddingPooler(PoolerConfig(pooling_type=pooling_type, normalize=True))
    torch.testing.assert_close(pooler.finish(state.result().unsqueeze(0), [PoolingParams()])[0],
                               F.normalize(whole.float(), dim=-1))


def _modules(tmp_path, *types: str, pooling: dict | None = None) -> None:
    modules = [{"idx": i, "name": str(i), "path": f"{i}_{t.rsplit('.', 1)[-1]}" if i else "", "type": t}
               for i, t in enumerate(types)]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    for m in modules:
        if m["type"].endswith("Pooling"):
            (tmp_path / m["path"]).mkdir(exist_ok=True)
            (tmp_path / m["path"] / "config.json").write_text(json.dumps(pooling or {}))


def test_sentence_transformers_files_give_the_pooling(tmp_path):
    assert read_sentence_transformers_config(tmp_path) is None  # no modules.json
    legacy = ("sentence_transformers.models.Transformer", "sentence_transformers.models.Pooling",
              "sentence_transformers.models.Normalize")
    _modules(tmp_path, *legacy, pooling={"word_embedding_dimension": 8, "pooling_mode_mean_tokens": True,
                                         "pooling_mode_cls_token": False})
    assert read_sentence_transformers_config(tmp_path) == PoolerConfig("MEAN", normalize=True)
    current = ("sentence_transformers.base.modules.transformer.Transformer",
               "sentence_transformers.sentence_transformer.modules.pooling.Pooling")
    _modules(tmp_path, *current, pooling={"embedding_dimension": 8, "pooling_mode": "lasttoken"})
    assert read_sentence_transformers_config(tmp_path) == PoolerConfig("LAST", normalize=False)
    # the override first, then the files, then the architecture's default
    resolved = resolve_pooler_config(tmp_path, PoolerConfig("CLS", normalize=True, dimensions=None),
                                     {"normalize": True})
    assert resolved == PoolerConfig("LAST", normalize=True)


@pytest.mark.parametrize(("types", "pooling", "field"), [
    (("x.Transformer", "x.Dense", "x.Pooling"), {"pooling_mode": "mean"}, "modules.json[1] (x.Dense)"),
    (("x.Transformer", "x.Pooling", "x.Normalize", "x.Dense"), {"pooling_mode": "mean"}, "modules.json[3] (x.Dense)"),
    (("x.Transformer", "x.Pooling", "x.LayerNorm"), {"pooling_mode": "mean"}, "modules.json[2] (x.LayerNorm)"),
    (("x.Transformer", "x.Pooling"), {"pooling_mode_max_tokens": True}, "1_Pooling/config.json pooling_mode"),
    (("x.Transformer", "x.Pooling"), {"pooling_mode": ["mean", "cls"]}, "1_Pooling/config.json pooling_mode"),
    (("x.Transformer", "x.Pooling"), {"pooling_mode": "mean", "include_prompt": False},
     "1_Pooling/config.json include_prompt"),
])
def test_what_sentence_transformers_does_and_gridserve_cannot_is_refused(tmp_path, types, pooling, field):
    _modules(tmp_path, *types, pooling=pooling)
    with pytest.raises(ConfigError) as info:
        read_sentence_transformers_config(tmp_path)
    assert info.value.field == field


def test_pooling_params_are_checked_naming_the_field():
    with pytest.raises(InvalidArgumentError) as info:
        PoolingParams(dimensions=0)
    assert info.value.field == "pooling_params.dimensions"
    with pytest.raises(InvalidArgumentError) as info:
        PoolingParams(task="generate")
    assert info.value.field == "pooling_params.task"
    with pytest.raises(InvalidArgumentError) as info:
        PoolingParams(task="score", normalize=True).verify(("classify", "score"), 8, {})
    assert info.value.field == "pooling_params.normalize"
    with pytest.raises(InvalidArgumentError) as info:
        PoolingParams(task="classify").verify(("embed",), 8, {})
    assert info.value.field == "pooling_params.task"
    assert matryoshka_dimensions({"is_matryoshka": True}) == ()
    PoolingParams(dimensions=5).verify(("embed",), 8, {"is_matryoshka": True})
    with pytest.raises(ConfigError) as info:
        PoolerConfig(pooling_type="MAX")
    assert info.value.field == "pooler_config.pooling_type"


def test_classifier_activation_follows_the_checkpoint_then_the_label_count():
    assert classifier_activation({"num_labels": 1}) == "sigmoid"
    assert classifier_activation({"id2label": {"0": "a", "1": "b", "2": "c"}}) == "softmax"
    assert classifier_activation({"num_labels": 1, "sentence_transformers": {
        "activation_fn": "torch.nn.modules.linear.Identity"}}) == "none"


def _meta(lens: list[int]) -> AttentionMetadata:
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return AttentionMetadata(starts, torch.tensor(lens, dtype=torch.int32), torch.zeros(len(lens), 1, dtype=torch.int32),
                             torch.zeros(sum(lens), dtype=torch.int64), max(lens))


def test_non_causal_attention_sees_each_whole_sequence_and_nothing_else():
    heads, d, lens = 2, 4, [5, 2, 7]
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(sum(lens), heads * d, generator=gen) for _ in range(3))
    layer = PagedAttention(heads, d, heads, d**-0.5, causal=False)
    out = layer(q, k, v, _meta(lens)).view(-1, heads, d)
    start = 0
    for n in lens:
        qs, ks, vs = (t[start:start + n].view(n, heads, d).transpose(0, 1) for t in (q, k, v))
        expected = torch.softmax(qs @ ks.transpose(-1, -2) * d**-0.5, -1) @ vs
        torch.testing.assert_close(out[start:start + n], expected.transpose(0, 1))
        start += n
    causal = PagedAttention(heads, d, heads, d**-0.5)(q, k, v, _meta(lens)).view(-1, heads, d)
    torch.testing.assert_close(causal[-1], out[-1])  # a sequence's last row sees all of it either way
    assert not torch.allclose(causal[0], out[0])  # its first row sees only itself when causal
    with pytest.raises(ValueError, match="non-causal"):
        PagedAttention(heads, d, heads, 1.0, causal=False, alibi_slopes=torch.ones(heads))
    layer.kv_cache = torch.zeros(2, 1, 16, heads, d)
    with pytest.raises(RuntimeError, match="without a KV cache"):
        layer(q, k, v, _meta(lens))


def _dense_bidirectional(q, k, v, lens, heads, kv_heads, d, scale, window=0, cap=0.0) -> torch.Tensor:
    """Float64, written out: each token over its whole sequence, keys ``|i - j| >= window`` masked,
    scores soft-capped (``cap * tanh(s / cap)``), K/V heads shared by ``heads / kv_heads`` queries."""
    out, start = [], 0
    for n in lens:
        qs = q[start:start + n].double().view(n, heads, d).transpose(0, 1)
        ks, vs = (t[start:start + n].double().view(n, kv_heads, d).transpose(0, 1)
                  .repeat_interleave(heads // kv_heads, 0) for t in (k, v))
        s = qs @ ks.transpose(-1, -2) * scale
        if cap:
            s = cap * torch.tanh(s / cap)
        if window:
            idx = torch.arange(n)
            s = s.masked_fill((idx[:, None] - idx[None, :]).abs() >= window, float("-inf"))
        out.append((torch.softmax(s, -1) @ vs).transpose(0, 1).reshape(n, heads * d))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize(("window", "cap"), [(5, 3.0), (5, None), (None, 3.0), (64, 3.0)],
                         ids=["window-and-cap", "window", "cap", "wide-window"])
def test_non_causal_window_and_soft_cap_see_the_window_either_side(monkeypatch, window, cap):
    """A bidirectional decoder's layer (EmbeddingGemma): query ``i`` sees key ``j`` iff
    ``|i - j| < window``, soft-capped scores, GQA; a small score budget splits the long sequence
    into query chunks, each over only the keys its window reaches."""
    from gridserve.kernels import reference

    monkeypatch.setattr(reference, "_SCORE_BUDGET", 4 * 6 * 20)  # 16-row chunks
    heads, kv_heads, d, lens = 6, 2, 8, [37, 1, 4, 70]
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(sum(lens), heads * d, generator=gen) * 2
    k, v = (torch.randn(sum(lens), kv_heads * d, generator=gen) * 2 for _ in range(2))
    layer = PagedAttention(heads, d, kv_heads, 0.3, sliding_window=window, logits_soft_cap=cap, causal=False)
    out = layer(q, k, v, _meta(lens))
    want = _dense_bidirectional(q, k, v, lens, heads, kv_heads, d, 0.3, window or 0, cap or 0.0)
    torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=2e-6)
    causal = PagedAttention(heads, d, kv_heads, 0.3, sliding_window=window, logits_soft_cap=cap)(q, k, v, _meta(lens))
    assert not torch.allclose(causal, out)  # the tokens ahead count
