"""Encoders: BERT and XLM-RoBERTa as one configurable module, for embeddings and cross-encoders.

Token, learned absolute position and token type embeddings summed and LayerNorm'd; then post-norm
blocks (``x = LN(x + attention(x))``, ``x = LN(x + mlp(x))``) with bidirectional attention over each
whole sequence and a plain activation MLP (GELU). The options that differ between the two:
``position_offset`` (XLM-R's positions start at ``padding_idx + 1``, BERT's at 0) and the heads of
the sequence classifiers, as transformers defines them: BERT's pooler (dense + tanh on [CLS]) then
``classifier``; RoBERTa's ``classifier`` head (dense + tanh + ``out_proj`` on <s>).

Built on the shared layer library: Q/K/V merged into one column-parallel GEMM, row-parallel output
and down projections, a vocab-parallel token embedding (tensor parallelism splits the heads and the
MLP as it does a decoder's), the loader's ``WeightMap`` from Hugging Face names onto this layout::

    model.embeddings.{word_embeddings, position_embeddings, token_type_embeddings, LayerNorm}
    model.layers.N.attention.{qkv_proj, o_proj}, .attention_norm, .mlp.{fc_in, fc_out}, .mlp_norm
    model.pooler.dense (BERT's classifier), classifier (.dense / .out_proj: RoBERTa's)

Sequences are packed without padding (``query_start_loc``) and attend without a KV cache
(``attention_layers`` is empty: the runner allocates none). Pooling-only: ``pooler`` turns the
final hidden states into embeddings (``*Model``: CLS pooling, normalised, unless the checkpoint's
sentence-transformers files say otherwise; their ``Dense`` modules, if any, in ``sentence_dense``)
or scores (``*ForSequenceClassification``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from gridserve.services.worker.attention import AttentionMetadata, PagedAttention
from gridserve.services.worker.checkpoint import CheckpointTensor
from gridserve.services.worker.dense_stack import dense_stack, load_dense_weights
from gridserve.services.worker.models.hf_config import hf_config_of
from gridserve.services.worker.models.layernorm_decoder import (
    Activation,
    DenseMLP,
    activation,
    head_dim_of,
)
from gridserve.services.worker.parallel_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    add_prefix,
)
from gridserve.services.worker.parallel_state import ParallelState, get_parallel_state
from gridserve.services.worker.pooler import Pooler, classifier_pooler, embedding_pooler
from gridserve.services.worker.weight_loader import WeightMap, load_weights
from gridserve.shared.config import GridserveConfig
from gridserve.shared.errors import ConfigError
from gridserve.shared.parallel import Shard, even_shard
from gridserve.shared.pooling import CLS, PoolerConfig, num_labels, padding_position_offset


@dataclass(frozen=True)
class EncoderSpec:
    """One encoder's sizes and options, read from its config.json."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    act: Activation
    norm_eps: float
    max_positions: int  # rows of the position table
    type_vocab_size: int  # rows of the token type table (XLM-R: 1)
    position_offset: int = 0  # the table row of a sequence's first token (XLM-R: padding_idx + 1)

    @property
    def max_tokens(self) -> int:
        """The longest input the position table covers."""
        return self.max_positions - self.position_offset


def encoder_spec(hf: Any, position_offset: int = 0) -> EncoderSpec:
    """BERT's config.json (RoBERTa's and XLM-R's share its keys) -> ``EncoderSpec``; what this
    encoder cannot honour is refused naming the key."""
    kind = getattr(hf, "position_embedding_type", None) or "absolute"
    if kind != "absolute":
        raise ConfigError("model.hf_config.position_embedding_type",
                          f"{kind!r} is not supported (supported: absolute)")
    for key in ("is_decoder", "add_cross_attention"):
        if getattr(hf, key, False):
            raise ConfigError(f"model.hf_config.{key}", "true is not supported: gridserve's encoders are encoders")
    heads = hf.num_attention_heads
    head_dim_of(hf.hidden_size, heads)
    return EncoderSpec(
        vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, num_layers=hf.num_hidden_layers, num_heads=heads,
        intermediate_size=hf.intermediate_size,
        act=activation(getattr(hf, "hidden_act", None) or "gelu", "model.hf_config.hidden_act"),
        norm_eps=getattr(hf, "layer_norm_eps", None) or 1e-12,
        max_positions=getattr(hf, "max_position_embeddings", None) or 512,
        type_vocab_size=getattr(hf, "type_vocab_size", None) or 2,
        position_offset=position_offset,
    )


class EncoderEmbeddings(nn.Module):
    """``LayerNorm(token + token_type + position)``: the token table vocab-parallel, the position and
    token type tables whole on every rank."""

    def __init__(self, spec: EncoderSpec, state: ParallelState, prefix: str = "") -> None:
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(spec.vocab_size, spec.hidden_size, state,
                                                      prefix=add_prefix(prefix, "word_embeddings"))
        self.position_embeddings = nn.Embedding(spec.max_positions, spec.hidden_size)
        self.token_type_embeddings = nn.Embedding(spec.type_vocab_size, spec.hidden_size)
        self.LayerNorm = nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps)
        self.position_offset = spec.position_offset

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = self.word_embeddings(input_ids)
        if token_type_ids is None:  # type 0 everywhere, as transformers' buffer of zeros
            x = x + self.token_type_embeddings.weight[0]
        else:
            x = x + self.token_type_embeddings(token_type_ids)
        if self.position_offset:
            positions = positions + self.position_offset
        x = x + self.position_embeddings(positions)  # added last, in transformers' order
        return self.LayerNorm(x)


class EncoderAttention(nn.Module):
    """Bidirectional multi-head attention: merged Q/K/V (column-parallel, ``heads / tp`` per rank),
    each packed sequence attending to itself whole, a row-parallel output projection."""

    def __init__(self, spec: EncoderSpec, state: ParallelState, prefix: str = "") -> None:
        super().__init__()
        heads = even_shard(spec.num_heads, state.tp_size, state.tp_rank, "num_attention_heads")
        d = spec.hidden_size // spec.num_heads
        self.num_heads = heads.size
        cols = Shard(heads.start * d, heads.size * d, heads.total * d)
        self.qkv_proj = ColumnParallelLinear(spec.hidden_size, [cols, cols, cols], bias=True,
                                             prefix=add_prefix(prefix, "qkv_proj"))
        self.o_proj = RowParallelLinear(cols, spec.hidden_size, bias=True, state=state,
                                        prefix=add_prefix(prefix, "o_proj"))
        self.attn = PagedAttention(self.num_heads, d, self.num_heads, d**-0.5, causal=False)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.output_sizes, dim=-1)
        return self.o_proj(self.attn(q, k, v, meta))


class EncoderLayer(nn.Module):
    """A post-norm block: ``x = LN(x + attention(x))``, then ``x = LN(x + mlp(x))``."""

    def __init__(self, spec: EncoderSpec, state: ParallelState, prefix: str = "") -> None:
        super().__init__()
        self.attention = EncoderAttention(spec, state, add_prefix(prefix, "attention"))
        self.attention_norm = nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps)
        self.mlp = DenseMLP(spec.hidden_size, spec.intermediate_size, spec.act, True, state,
                            add_prefix(prefix, "mlp"))
        self.mlp_norm = nn.LayerNorm(spec.hidden_size, eps=spec.norm_eps)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.attention_norm(x + self.attention(x, meta))
        return self.mlp_norm(x + self.mlp(x))


class BertPooler(nn.Module):
    """BERT's pooler: ``tanh(dense(h))`` of the [CLS] row (whole on every rank: it is small)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(x))


class Encoder(nn.Module):
    """Embeddings and the encoder layers (and BERT's pooler, for its sequence classifier)."""

    def __init__(self, spec: EncoderSpec, state: ParallelState, prefix: str = "model",
                 bert_pooler: bool = False) -> None:
        super().__init__()
        self.embeddings = EncoderEmbeddings(spec, state, add_prefix(prefix, "embeddings"))
        self.layers = nn.ModuleList(EncoderLayer(spec, state, add_prefix(prefix, f"layers.{i}"))
                                    for i in range(spec.num_layers))
        if bert_pooler:
            self.pooler = BertPooler(spec.hidden_size)

    def forward(self, input_ids, positions, meta: AttentionMetadata,
                token_type_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = self.embeddings(input_ids, positions, token_type_ids)
        for layer in self.layers:
            x = layer(x, meta)
        return x


# Hugging Face names (BERT, RoBERTa, XLM-R; with or without the ``bert.`` / ``roberta.`` prefix of
# a task model, TF-era ``gamma`` / ``beta``) -> the layout above
_RENAME = (
    (r"^(bert|roberta|model)\.", ""),
    (r"^(embeddings|encoder|pooler)\.", r"model.\1."),
    (r"^model\.encoder\.layer\.", "model.layers."),
    (r"\.gamma$", ".weight"),
    (r"\.beta$", ".bias"),
    (r"\.attention\.self\.(query|key|value)\.", r".attention.\1."),
    (r"\.attention\.output\.dense\.", ".attention.o_proj."),
    (r"\.attention\.output\.LayerNorm\.", ".attention_norm."),
    (r"\.intermediate\.dense\.", ".mlp.fc_in."),
    (r"\.output\.dense\.", ".mlp.fc_out."),
    (r"\.output\.LayerNorm\.", ".mlp_norm."),
)
_STACKED = (("query", "qkv_proj", 0), ("key", "qkv_proj", 1), ("value", "qkv_proj", 2))
# buffers, and heads no pooling model here uses (masked-LM heads, a base model's unused pooler)
_BUFFERS = (r"\.position_ids$", r"\.token_type_ids$")
_UNUSED_HEADS = (r"^cls\.", r"^lm_head\.", r"^(bert\.|roberta\.)?pooler\.")


class EncoderModel(nn.Module):
    """An encoder served by the pooling runner; a subclass picks the options and the head.

    ``forward(input_ids, positions, meta, token_type_ids=None)`` gives the final hidden states of
    the packed tokens (``positions`` count from 0 in each sequence, as the runner makes them);
    ``pooler`` (``gridserve.services.worker.pooler``) makes them vectors or scores. Pipeline
    parallelism is refused (the registry marks these models TP only).
    """

    is_pooling_model = True
    takes_token_type_ids = True
    supported_tasks: tuple[str, ...] = ()
    bert_pooler = False  # BERT's classifier reads the pooler's output
    positions_after_padding = False  # RoBERTa's positions start at padding_idx + 1

    def __init__(self, *, config: GridserveConfig, prefix: str = "") -> None:
        super().__init__()
        hf = hf_config_of(config)
        self.state = get_parallel_state()
        if self.state.pp_size > 1:
            raise ConfigError("parallel.pipeline_parallel_size", f"{type(self).__name__} is not split into stages")
        self.prefix = prefix
        offset = padding_position_offset(config.model.hf_config) if self.positions_after_padding else 0
        self.spec = encoder_spec(hf, offset)
        self.max_input_tokens = self.spec.max_tokens
        self.model = Encoder(self.spec, self.state, add_prefix(prefix, "model"), self.bert_pooler)
        self.build_head(hf)
        self.pooler: Pooler = self.make_pooler(config)
        self.weight_map = WeightMap(skip=_BUFFERS + self.skipped(), rename=_RENAME, stacked=_STACKED)

    def build_head(self, hf: Any) -> None:
        """Add the classifier's modules (none for an embedding model)."""

    def make_pooler(self, config: GridserveConfig) -> Pooler:
        # vLLM's BERT embedder default: the [CLS] row, normalised
        self.sentence_dense = dense_stack(config, self.spec.hidden_size)
        return embedding_pooler(config, self.spec.hidden_size, PoolerConfig(pooling_type=CLS, normalize=True),
                                self.sentence_dense)

    def skipped(self) -> tuple[str, ...]:
        """Checkpoint tensors this model does not read."""
        return _UNUSED_HEADS

    def forward(self, input_ids, positions, meta: AttentionMetadata, intermediate=None, inputs_embeds=None,
                token_type_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        if intermediate is not None or inputs_embeds is not None:
            raise ValueError(f"{type(self).__name__} takes token ids only (no pipeline stages, no embeddings)")
        return self.model(input_ids, positions, meta, token_type_ids)

    def attention_layers(self) -> list[PagedAttention]:
        """None with a KV cache: the encoder attends over each whole sequence, keeping nothing."""
        return []

    def compute_logits(self, hidden: torch.Tensor) -> Optional[torch.Tensor]:
        raise RuntimeError(f"{type(self).__name__} is a pooling model: it has no language-model head "
                           "(use its pooler)")

    def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> set[str]:
        """Copy this rank's part of each checkpoint tensor (and the Dense modules' weights, read
        from their folders); return the names of parameters loaded."""
        return load_weights(self, weights, self.weight_map) | load_dense_weights(self)


class BertModel(EncoderModel):
    """BERT as an embedder (bge, all-MiniLM, ...): the token embeddings pooled by the pooler."""

    supported_tasks = ("embed",)


class XLMRobertaModel(BertModel):
    """XLM-RoBERTa as an embedder (bge-m3, multilingual-e5): positions from ``padding_idx + 1``."""

    positions_after_padding = True


class SequenceClassifier(EncoderModel):
    """An encoder with a classifier over its first row: ``classify`` tasks, and ``score`` (one
    relevance score per input pair) when it has one label (a cross-encoder)."""

    supported_tasks = ("classify", "score")

    def make_pooler(self, config: GridserveConfig) -> Pooler:
        pooler = classifier_pooler(config, self.classify)
        self.supported_tasks = pooler.supported_tasks
        return pooler

    def classify(self, cls_rows: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` first rows -> ``[n, num_labels]`` logits."""
        return self.classifier(cls_rows)


class BertForSequenceClassification(SequenceClassifier):
    """BERT with its sequence classifier: ``classifier(tanh(pooler.dense([CLS])))``, ``num_labels`` out."""

    bert_pooler = True

    def build_head(self, hf: Any) -> None:
        self.classifier = nn.Linear(self.spec.hidden_size, _labels(hf))

    def classify(self, cls_rows: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.model.pooler(cls_rows))

    def skipped(self) -> tuple[str, ...]:
        return (r"^cls\.", r"^lm_head\.")


class RobertaClassificationHead(nn.Module):
    """RoBERTa's classification head on the <s> row: ``out_proj(tanh(dense(h)))``."""

    def __init__(self, hidden_size: int, num_labels: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.out_proj = nn.Linear(hidden_size, num_labels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(x)))


class XLMRobertaForSequenceClassification(SequenceClassifier):
    """XLM-RoBERTa with RoBERTa's classification head (a cross-encoder reranker: bge-reranker)."""

    positions_after_padding = True

    def build_head(self, hf: Any) -> None:
        self.classifier = RobertaClassificationHead(self.spec.hidden_size, _labels(hf))


def _labels(hf: Any) -> int:
    return num_labels(vars(hf))
