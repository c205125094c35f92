"""A generative decoder served as an embedder (vLLM's ``as_embedding_model``, ``--convert embed``).

``as_embedding_model(Qwen3ForCausalLM)`` is the same decoder without its LM head, whose final
hidden states (what the decoders' ``forward`` returns on the last pipeline stage) a pooler turns
into one vector per sequence: the last token's, L2-normalised, unless the checkpoint's
sentence-transformers files or the operator's pooler config say otherwise (Qwen3-Embedding,
e5-mistral, gte-Qwen); the files' ``Dense`` modules then project it (``sentence_dense``: a
``DenseStack``, its weights read from the modules' folders with the decoder's). Each input runs
whole, in one step, without a KV cache (the pooling runner). The decoder keeps its causal attention unless its config makes it bidirectional (Gemma's
``use_bidirectional_attention``: EmbeddingGemma, usually mean-pooled by its sentence-transformers
files); its ``decoder_spec`` sees ``is_pooling_model`` on the class, so only the embedder accepts it.

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
from gridserve.services.worker.dense_stack import dense_stack, load_dense_weights
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
            self.sentence_dense = dense_stack(config, hidden)
            self.pooler = embedding_pooler(config, hidden, PoolerConfig(pooling_type=LAST, normalize=True),
                                           self.sentence_dense)

        def compute_logits(self, hidden):
            raise RuntimeError(f"{type(self).__name__} is a pooling model: it has no language-model head "
                               "(use its pooler)")

        def load_weights(self, weights: Iterable[tuple[str, CheckpointTensor]]) -> set[str]:
            loaded = super().load_weights((_prefixed(name), tensor) for name, tensor in weights
                                          if not name.startswith("lm_head."))
            return loaded | load_dense_weights(self)

    name = model_class.__name__.replace("ForCausalLM", "") + "ForEmbedding"
    EmbeddingModel.__name__ = EmbeddingModel.__qualname__ = name
    EmbeddingModel.__module__ = model_class.__module__
    return EmbeddingModel


def _prefixed(name: str) -> str:
    return f"model.{name}" if _BARE.match(name) else name
