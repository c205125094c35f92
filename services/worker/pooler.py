"""Pooling: a pooling model's final hidden states -> one embedding or one set of scores per sequence.

The step's sequences are packed as the decoders' are (``query_start_loc``, no padding tokens);
``pool_hidden`` reduces each sequence's rows to one (``LAST``: its last token, ``CLS``: its first,
``MEAN``: the mean of all of them, accumulated in float32, then in the activations' dtype). Then:

- ``EmbeddingPooler`` (task ``embed``): the checkpoint's sentence-transformers ``Dense`` modules
  when it has them (``projection``: the model's ``DenseStack``), then each request's Matryoshka
  ``dimensions`` (the leading values kept, then) and ``normalize`` (L2, as sentence-transformers'
  ``Normalize``), float32 out;
- ``ClassifierPooler`` (tasks ``classify`` / ``score``): the model's head over the pooled row
  (BERT's pooler + classifier, RoBERTa's classification head), then sigmoid / softmax / none per
  ``PoolerConfig.activation`` unless the request turns it off (``activation=False``: raw logits).

A pooling model (``is_pooling_model``) carries ``pooler`` (one of these) and ``supported_tasks``;
its ``forward(input_ids, positions, meta, ...)`` returns the final hidden states of every
scheduled token (encoders take ``token_type_ids=`` too, when ``takes_token_type_ids``). The
runner's step is then ``model.pooler(hidden, PoolingMetadata(query_start_loc, params))``;
``run_pooling`` is that step for whole sequences without a KV cache (offline use and tests).
Under tensor parallelism the hidden states are whole on every rank (the row-parallel layers
all-reduce), so every rank pools the same values and the runner reads rank 0's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from gridserve.services.worker.attention import AttentionMetadata
from gridserve.services.worker.dense_stack import DenseStack
from gridserve.shared.errors import InvalidArgumentError
from gridserve.shared.pooling import (
    CLASSIFY,
    CLS,
    EMBED,
    LAST,
    MEAN,
    SCORE,
    SIGMOID,
    SOFTMAX,
    PoolerConfig,
    PoolingParams,
    check_default_dimensions,
    classifier_activation,
    num_labels,
    resolve_pooler_config,
)


@dataclass
class PoolingMetadata:
    """One step's pooled sequences: where each lies in the packed rows, and what its request asks."""

    query_start_loc: torch.Tensor  # [num_seqs + 1], int, the rows of sequence i: [qsl[i], qsl[i + 1])
    params: Sequence[PoolingParams]

    def __post_init__(self) -> None:
        if len(self.params) != self.query_start_loc.numel() - 1:
            raise ValueError(f"PoolingMetadata: {len(self.params)} params for "
                             f"{self.query_start_loc.numel() - 1} sequences")


def pool_hidden(hidden: torch.Tensor, query_start_loc: torch.Tensor, pooling_type: str) -> torch.Tensor:
    """``[num_seqs, hidden]``: each packed sequence's rows of ``hidden`` ([tokens, hidden]) reduced
    to one by ``pooling_type``; ``MEAN`` in float32 (sentence-transformers accumulates 16-bit
    inputs in float32 too), the others in ``hidden``'s dtype. An empty sequence is refused."""
    qsl = query_start_loc.to(device=hidden.device, dtype=torch.long)
    lens = qsl[1:] - qsl[:-1]
    if bool((lens <= 0).any()):
        raise ValueError("pool_hidden: every sequence needs at least one token")
    if pooling_type == LAST:
        return hidden[qsl[1:] - 1]
    if pooling_type == CLS:
        return hidden[qsl[:-1]]
    if pooling_type == MEAN:
        seq = torch.repeat_interleave(torch.arange(lens.numel(), device=hidden.device), lens)
        sums = torch.zeros(lens.numel(), hidden.shape[-1], device=hidden.device, dtype=torch.float32)
        sums.index_add_(0, seq, hidden.float())
        return sums / lens.unsqueeze(-1).to(torch.float32)
    raise ValueError(f"unknown pooling type {pooling_type!r}")


class Pooler:
    """Hidden states -> one float32 tensor per sequence. Holds no parameters (a model's head is
    called through the function it was given), so it is a plain object beside the model's modules."""

    pooling_type: str
    supported_tasks: tuple[str, ...]

    def __call__(self, hidden: torch.Tensor, meta: PoolingMetadata) -> list[torch.Tensor]:
        """Each whole sequence of the step (its rows of ``hidden``) -> its output."""
        self._check_tasks(meta)
        # a mean back in the activations' dtype, as sentence-transformers gives it (float32 stays so)
        pooled = pool_hidden(hidden, meta.query_start_loc, self.pooling_type).to(hidden.dtype)
        return self.finish(pooled, meta.params)

    def finish(self, pooled: torch.Tensor, params: Sequence[PoolingParams]) -> list[torch.Tensor]:
        """Pooled rows (``[n, hidden]``: ``pool_hidden``'s, or ``ChunkedPool.result``'s stacked)
        -> each request's output."""
        raise NotImplementedError

    def _check_tasks(self, meta: PoolingMetadata) -> None:
        for params in meta.params:
            if params.task not in self.supported_tasks:
                raise InvalidArgumentError("pooling_params.task", f"{params.task!r} is not served by this model; "
                                                                  f"it serves {', '.join(self.supported_tasks)}")


class EmbeddingPooler(Pooler):
    """Task ``embed``: the pooled row, through ``projection`` (the model's Dense modules, if any),
    truncated to ``dimensions`` and L2-normalised as asked.

    ``config`` is resolved (``pooling_type`` and ``normalize`` set); a request's ``dimensions`` /
    ``normalize`` override its defaults, once ``PoolingParams.verify`` has accepted them.
    """

    supported_tasks = (EMBED,)

    def __init__(self, config: PoolerConfig,
                 projection: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> None:
        if config.pooling_type is None or config.normalize is None:
            raise ValueError(f"EmbeddingPooler needs a resolved config, got {config}")
        self.config = config
        self.pooling_type = config.pooling_type
        self.projection = projection

    def finish(self, pooled: torch.Tensor, params: Sequence[PoolingParams]) -> list[torch.Tensor]:
        if self.projection is not None:
            pooled = self.projection(pooled)
        pooled = pooled.float()
        settings = [(p.dimensions or self.config.dimensions,
                     self.config.normalize if p.normalize is None else p.normalize) for p in params]
        if len(set(settings)) == 1:  # one setting for the whole step: one op over every row
            return list(self._finish(pooled, *settings[0]).unbind(0))
        return [self._finish(row.unsqueeze(0), *s)[0] for row, s in zip(pooled, settings)]

    @staticmethod
    def _finish(rows: torch.Tensor, dimensions: Optional[int], normalize: bool) -> torch.Tensor:
        if dimensions is not None:
            rows = rows[:, :dimensions]
        return F.normalize(rows, p=2, dim=-1) if normalize else rows


class ClassifierPooler(Pooler):
    """Tasks ``classify`` / ``score``: ``head`` (the model's classifier, ``[n, hidden] -> [n, labels]``)
    over the pooled rows, then ``activation`` unless a request sets ``activation=False``.

    One tensor of ``num_labels`` values per sequence (a cross-encoder: one value, its relevance
    score). ``score`` is served by a one-label head only (vLLM's rule); ``classify`` by any.
    """

    def __init__(self, pooling_type: str, head: Callable[[torch.Tensor], torch.Tensor], activation: str,
                 num_labels: int) -> None:
        self.supported_tasks = (CLASSIFY, SCORE) if num_labels == 1 else (CLASSIFY,)
        self.pooling_type = pooling_type
        self.head = head
        self.activation = activation
        self.num_labels = num_labels

    def finish(self, pooled: torch.Tensor, params: Sequence[PoolingParams]) -> list[torch.Tensor]:
        logits = self.head(pooled).float()
        activated = self.activate(logits)
        return [activated[i] if p.activation is not False else logits[i] for i, p in enumerate(params)]

    def activate(self, logits: torch.Tensor) -> torch.Tensor:
        if self.activation == SIGMOID:
            return torch.sigmoid(logits)
        if self.activation == SOFTMAX:
            return torch.softmax(logits, dim=-1)
        return logits


class ChunkedPool:
    """One sequence's pooling over the chunks its prefill was split into (a causal embedder the
    scheduler chunked): ``add`` each chunk's rows in order, ``result`` after the last; then
    ``Pooler.finish`` over the stacked results. ``MEAN`` keeps a float32 sum and a count, ``CLS``
    the first chunk's first row, ``LAST`` the latest chunk's last row (so the runner may pool
    only the last chunk). An encoder or a bidirectional decoder is never chunked."""

    def __init__(self, pooling_type: str) -> None:
        if pooling_type not in (LAST, MEAN, CLS):
            raise ValueError(f"unknown pooling type {pooling_type!r}")
        self.pooling_type = pooling_type
        self.count = 0
        self._row: Optional[torch.Tensor] = None

    def add(self, rows: torch.Tensor) -> None:
        if rows.shape[0] == 0:
            return
        if self.pooling_type == MEAN:
            total = rows.float().sum(0)
            self._row = total if self._row is None else self._row + total
        elif self.pooling_type == LAST or self._row is None:
            self._row = (rows[-1] if self.pooling_type == LAST else rows[0]).clone()
        self.count += rows.shape[0]

    def result(self) -> torch.Tensor:
        if self._row is None:
            raise ValueError("ChunkedPool: no rows were added")
        return self._row / self.count if self.pooling_type == MEAN else self._row


def embedding_pooler(config: Any, hidden_size: int, default: PoolerConfig,
                     dense: Optional[DenseStack] = None) -> EmbeddingPooler:
    """The ``embed`` pooler of a model loaded from ``config`` (a ``GridserveConfig``): the operator's
    ``model.pooler_config`` (when the config has one), the checkpoint's sentence-transformers files,
    then the architecture's ``default``; ``dense``: the model's Dense modules (``dense_stack``),
    applied to the pooled rows; a default ``dimensions`` checked against the vectors' size."""
    model = config.model
    resolved = resolve_pooler_config(model.model_path, default, getattr(model, "pooler_config", None))
    size = hidden_size if dense is None else dense.out_features
    check_default_dimensions(resolved, size, model.hf_config)
    return EmbeddingPooler(resolved, dense)


def classifier_pooler(config: Any, head: Callable[[torch.Tensor], torch.Tensor],
                      pooling_type: str = CLS) -> ClassifierPooler:
    """The ``classify`` / ``score`` pooler of a model loaded from ``config`` with classifier ``head``:
    ``pooling_type`` as the architecture defines it (the head is trained on that row), the
    activation from ``model.pooler_config`` or the checkpoint (``classifier_activation``)."""
    hf = config.model.hf_config
    override = PoolerConfig.of(getattr(config.model, "pooler_config", None))
    activation = override.activation or classifier_activation(hf)
    return ClassifierPooler(pooling_type, head, activation, num_labels(hf))


@torch.inference_mode()
def run_pooling(model: nn.Module, prompts: Sequence[Sequence[int]], params: Sequence[PoolingParams],
                token_type_ids: Optional[Sequence[Optional[Sequence[int]]]] = None) -> list[torch.Tensor]:
    """One pooling step over whole sequences, packed without padding and without a KV cache: each
    prompt's vector (or scores). ``token_type_ids``: per prompt (None: all zeros), for a model that
    ``takes_token_type_ids`` (BERT's sentence pairs)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise InvalidArgumentError("prompts", "each input needs at least one token")
    device = next(model.parameters()).device
    lens = [len(p) for p in prompts]
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = AttentionMetadata(query_start_loc=starts.to(device), seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
                             block_table=torch.zeros(len(lens), 1, dtype=torch.int32, device=device),
                             slot_mapping=torch.zeros(sum(lens), dtype=torch.int64, device=device),
                             max_query_len=max(lens))
    ids = torch.tensor([t for p in prompts for t in p], dtype=torch.long, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in lens])
    kwargs = {}
    if getattr(model, "takes_token_type_ids", False):
        types = token_type_ids or [None] * len(prompts)
        kwargs["token_type_ids"] = torch.tensor(
            [t for p, tt in zip(prompts, types) for t in (tt if tt is not None else [0] * len(p))],
            dtype=torch.long, device=device)
    elif token_type_ids is not None and any(t is not None and any(t) for t in token_type_ids):
        raise InvalidArgumentError("token_type_ids", "this model takes no token type ids")
    hidden = model(ids, positions, meta, **kwargs)
    return model.pooler(hidden, PoolingMetadata(starts, params))
