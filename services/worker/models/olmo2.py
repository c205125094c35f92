"""OLMo 2: the Llama decoder with norms after attention and MLP (none before), and Q/K RMSNorm over
the whole projection width.

Under tensor parallelism the Q/K norms all-reduce their sum of squares over the group
(``ProjectionRMSNorm``), so a sharded model computes the unsharded norm.
"""

from __future__ import annotations

from typing import Any

from gridserve.services.worker.models.llama import DecoderSpec, LlamaForCausalLM, llama_spec

OLMO2_NORMS = (None, "post_attention_layernorm", None, "post_feedforward_layernorm")


class Olmo2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_spec(cls, hf: Any) -> DecoderSpec:
        return llama_spec(hf, qk_norm="projection", norms=OLMO2_NORMS)
