"""A generative decoder served as an embedder (vLLM's ``as_embedding_model``, ``--convert embed``).

``as_embedding_model(Qwen3ForCausalLM)`` is the same decoder without its LM head, whose final
hidden states (what the decoders' ``forward`` returns on the last pipeline stage) a pooler turns
into one vector per sequence: the last token's, L2-normalised, unless the checkpoint's
sentence-transformers files or the operator's pooler config say otherwise (Qwen3-Embedding,
e5-mistral, gte-Qwen). The decoder keeps its causal attention and its paged KV cache, so a long
input may be chunked (last-token pooling reads only the last chunk's last row).

Embedding checkpoints are often saved from the bare decoder (``Qwen3Model``: ``layers.0...``, no
``model.`` prefix, no ``lm_head``): such names get the ``model.`` prefix, and an ``lm_head`` is
never read.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable

from torch import nn

from gridserve.services.worker.checkpoint import CheckpointTensor
from gridserve.services.worker.models.hf_config import hf_config_of
from gridserve.services.worker.pooler import embedding_pooler
from gridserve.shared.config import GridserveConfig
from gridserve.shared.pooling import LAST, PoolerConfig

# the bare decoder's top-level modules (Llama-family names) that a task model keeps under ``model.``
_BARE = re.compile(r"^(embed_tokens|layers|norm)\.")


@functools.cache
def as_embedding_model(model_class: type[nn.Module]) -> type[nn.Module]:
    """``model_class`` (a decoder whose ``forward`` returns final hidden states) as an embedder;
    one class per decoder class."""
    if getattr(model_class, "is_pooling_model", False):
        return model_class

    class EmbeddingModel(model_class):  # type: ignore[misc, valid-type]
        is_pooling_model = True
        takes_token_type_ids = False
        supported_tasks = ("embed",)

        def __init__(self, *, config: GridserveConfig, prefix: str = "") -> None:
            super().__init__(config=config, prefix=prefix)
            if hasattr(self, "lm_head"):
                del self.lm_head  # no logits: its tensor is left unread
            hidden = hf_config_of(config).hidden_size
            self.pooler = embedding_pooler(config, hidden, PoolerConfig(pooling_type=LAST, normalize=True))

        def compute_logits(self, hidden):
            raise RuntimeError(f"{type(self).__name__} is a pooling model: it has no language-model head "
                               "(use its pooler)")

        def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> set[str]:
            return super().load_weights((_prefixed(name), tensor) for name, tensor in weights
                                        if not name.startswith("lm_head."))

    name = model_class.__name__.replace("ForCausalLM", "") + "ForEmbedding"
    EmbeddingModel.__name__ = EmbeddingModel.__qualname__ = name
    EmbeddingModel.__module__ = model_class.__module__
    return EmbeddingModel


def _prefixed(name: str) -> str:
    return f"model.{name}" if _BARE.match(name) else name
