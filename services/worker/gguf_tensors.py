"""Where each GGUF tensor goes in an architecture's Hugging Face checkpoint, with llama.cpp's
converter steps undone.

``convert_hf_to_gguf.py`` renames a checkpoint's tensors (``gguf``'s ``tensor_mapping``) and, for
some architectures, rearranges them; each ``Layout`` names the tensors back and each step is
reversed here, so the tensors equal the safetensors checkpoint's and every model's ``load_weights``
reads them unchanged:

- llama, granite, smollm3: Q/K rows permuted for llama.cpp's RoPE (``LlamaModel.permute``; transformers'
  ``LlamaTensorProcessor`` reverses it) -> ``unpermute_qk``.
- gemma, gemma2, gemma3: every ``*norm.weight`` stored as ``1 + w`` (``GemmaModel.modify_tensors``;
  transformers' ``Gemma2TensorProcessor`` subtracts 1) -> minus 1.
- gpt2: the Conv1D ``(in, out)`` matrices transposed (``GPT2Model.modify_tensors``; transformers'
  ``GPT2TensorProcessor``) -> transposed back.
- gptneox, bloom: the per-head fused ``[heads, 3, head_dim]`` Q/K/V made ``[Q; K; V]``
  (``GPTNeoXModel`` / ``BloomModel.modify_tensors``; transformers' ``BloomTensorProcessor``) -> per
  head again.
- falcon: the per-KV-group ``[kv, heads / kv + 2, head_dim]`` Q/K/V made ``[Q; K; V]``
  (``FalconModel.modify_tensors``, jploski's layout) -> per group again (one KV head: already
  ``[Q; K; V]``, as the 7B's multi-query checkpoint stores it).
- stablelm: the per-head Q/K LayerNorms stacked into one ``[heads, head_dim]`` tensor
  (``StableLMModel._stack_qk_norm``) -> one tensor per head.
- llama with experts (Mixtral): the experts stacked ``[experts, rows, cols]`` -> one per expert.
- gptj: nothing to undo (GPT-J's rotary already pairs neighbouring dimensions, as llama.cpp's does).
- phi3, glm4: pre-fused ``qkv_proj`` / ``gate_up_proj`` kept as they are (``attn_qkv`` /
  ``ffn_up``: the models split them); phi2's older fused ``attn_qkv`` split into ``q/k/v_proj``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Optional

import torch

Transform = Callable[[torch.Tensor], torch.Tensor]
# (block index, GGUF part, weight / bias, tensor shape, HF config) -> a placement, or None: the table's
Hook = Callable[[str, str, str, tuple[int, ...], Mapping[str, Any]], Optional["Placement"]]

_GLOBAL = re.compile(r"^([a-z_]+)\.(weight|bias)$")
_BLOCK = re.compile(r"^blk\.(\d+)\.([a-z0-9_]+)\.(weight|bias)$")
_PER_EXPERT = re.compile(r"^blk\.(\d+)\.(ffn_gate|ffn_up|ffn_down)\.(\d+)\.weight$")
_EXPERT_PROJ = {"ffn_gate": "w1", "ffn_up": "w3", "ffn_down": "w2"}


@dataclass(frozen=True)
class Placement:
    """One GGUF tensor's place: the HF tensors it becomes, after ``transform`` undid the converter's
    rearrangement: the whole tensor (one name), or consecutive blocks of ``rows`` rows (one per name)."""

    names: tuple[str, ...]
    transform: Optional[Transform] = None
    rows: tuple[int, ...] = ()


SKIP = Placement(())  # a tensor the HF checkpoint has no counterpart for (its content is in the config)


def _no_hook(bid: str, part: str, kind: str, shape: tuple[int, ...], cfg: Mapping[str, Any]) -> None:
    return None


def _no_undo(part: str, cfg: Mapping[str, Any]) -> Optional[Transform]:
    return None


@dataclass(frozen=True)
class Layout:
    """An architecture's tensor names (GGUF global / per-block part -> HF name) and the converter
    steps to undo (``undo(part, hf_config)``); ``hook`` places what a table cannot (splits)."""

    globals: Mapping[str, str]
    blocks: Mapping[str, str]
    block_prefix: str = "model.layers.{bid}."
    skip: frozenset[str] = frozenset()
    undo: Callable[[str, Mapping[str, Any]], Optional[Transform]] = _no_undo
    hook: Hook = _no_hook
    per_expert: bool = False  # Mixtral's older one-tensor-per-expert names

    def hf_name(self, gguf_name: str) -> Optional[str]:
        """The HF name of a tensor the tables place whole; None otherwise."""
        match = _GLOBAL.match(gguf_name)
        if match is not None and match[1] in self.globals:
            return f"{self.globals[match[1]]}.{match[2]}"
        expert = _PER_EXPERT.match(gguf_name) if self.per_expert else None
        if expert is not None:
            layer, proj, index = expert.groups()
            return f"{self.block_prefix.format(bid=layer)}block_sparse_moe.experts.{index}.{_EXPERT_PROJ[proj]}.weight"
        match = _BLOCK.match(gguf_name)
        if match is None or match[2] not in self.blocks:
            return None
        return f"{self.block_prefix.format(bid=match[1])}{self.blocks[match[2]]}.{match[3]}"

    def place(self, gguf_name: str, shape: tuple[int, ...], cfg: Mapping[str, Any]) -> Optional[Placement]:
        """Where ``gguf_name`` goes for a model of config ``cfg``; None: nowhere (an error)."""
        if gguf_name in self.skip:
            return SKIP
        block = _BLOCK.match(gguf_name)
        if block is not None:
            placed = self.hook(block[1], block[2], block[3], shape, cfg)
            if placed is not None:
                return placed
        name = self.hf_name(gguf_name)
        if name is None:
            return None
        part = block[2] if block is not None else gguf_name.rpartition(".")[0]
        return Placement((name,), self.undo(part, cfg))


# ---- the converter's steps, undone ---------------------------------------------------------------------
def _heads(cfg: Mapping[str, Any]) -> tuple[int, int, int]:
    """(query heads, KV heads, head size) of an HF config (its standard size keys filled in)."""
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    return heads, kv_heads, int(cfg.get("head_dim") or cfg["hidden_size"] // heads)


def unpermute_qk(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's ``permute``: its rows (per head: pairs interleaved) back to HF's halves."""
    shape = weight.shape
    return (weight.reshape(n_head, shape[0] // n_head // 2, 2, *shape[1:]).transpose(1, 2)
            .reshape(shape).contiguous())


def per_group_qkv(heads: int, kv_heads: int, head_dim: int) -> Transform:
    """``[Q; K; V]`` rows (weight or bias) -> per KV group: its query heads, its key, its value
    (``[kv, heads / kv + 2, head_dim]``; with a group per head, GPT-NeoX / Bloom's ``[heads, 3, d]``)."""
    group = heads // kv_heads

    def regroup(x: torch.Tensor) -> torch.Tensor:
        rest = tuple(x.shape[1:])
        q, k, v = x.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim])
        parts = (q.reshape(kv_heads, group, head_dim, *rest), k.reshape(kv_heads, 1, head_dim, *rest),
                 v.reshape(kv_heads, 1, head_dim, *rest))
        return torch.cat(parts, dim=1).reshape(x.shape)

    return regroup


def _minus_one(x: torch.Tensor) -> torch.Tensor:
    return x - 1.0


def _transposed(x: torch.Tensor) -> torch.Tensor:
    return x.t().contiguous() if x.dim() == 2 else x


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1)


def _undo_llama_permute(part: str, cfg: Mapping[str, Any]) -> Optional[Transform]:
    heads, kv_heads, _ = _heads(cfg)
    if part == "attn_q":
        return lambda x: unpermute_qk(x, heads)
    if part == "attn_k":
        return lambda x: unpermute_qk(x, kv_heads)
    return None


def _undo_gemma_norms(part: str, cfg: Mapping[str, Any]) -> Optional[Transform]:
    return _minus_one if part.endswith("norm") else None


def _undo_gpt2_transpose(part: str, cfg: Mapping[str, Any]) -> Optional[Transform]:
    return _transposed if part in ("attn_qkv", "attn_output", "ffn_up", "ffn_down") else None


def _undo_qkv_per_group(part: str, cfg: Mapping[str, Any]) -> Optional[Transform]:
    if part != "attn_qkv":
        return None
    heads, kv_heads, head_dim = _heads(cfg)
    return None if kv_heads == 1 else per_group_qkv(heads, kv_heads, head_dim)


# ---- splits ------------------------------------------------------------------------------------------
def _mixtral_experts(bid: str, part: str, kind: str, shape: tuple[int, ...], cfg: Mapping[str, Any]):
    """``ffn_{gate,up,down}_exps`` ``[experts, rows, cols]`` -> one ``[rows, cols]`` per expert."""
    proj = part.removesuffix("_exps")
    if proj == part or proj not in _EXPERT_PROJ:
        return None
    experts, rows, cols = shape
    names = tuple(f"model.layers.{bid}.block_sparse_moe.experts.{e}.{_EXPERT_PROJ[proj]}.weight"
                  for e in range(experts))
    return Placement(names, lambda x: x.reshape(experts * rows, cols), (rows,) * experts)


def _stablelm_qk_norms(bid: str, part: str, kind: str, shape: tuple[int, ...], cfg: Mapping[str, Any]):
    """``attn_{q,k}_norm`` ``[heads, head_dim]`` -> ``{q,k}_layernorm.norms.{i}`` (one per head)."""
    if part not in ("attn_q_norm", "attn_k_norm"):
        return None
    heads, head_dim = shape
    which = part[5]
    names = tuple(f"model.layers.{bid}.self_attn.{which}_layernorm.norms.{i}.{kind}" for i in range(heads))
    return Placement(names, _flat, (head_dim,) * heads)


def _phi2_fused_qkv(bid: str, part: str, kind: str, shape: tuple[int, ...], cfg: Mapping[str, Any]):
    """Older Phi-2 files' ``attn_qkv`` (``mixer.Wqkv``, ``[Q; K; V]``) -> ``q_proj``, ``k_proj``, ``v_proj``."""
    if part != "attn_qkv":
        return None
    heads, kv_heads, head_dim = _heads(cfg)
    names = tuple(f"model.layers.{bid}.self_attn.{p}_proj.{kind}" for p in "qkv")
    return Placement(names, None, (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim))


def _falcon_norms(bid: str, part: str, kind: str, shape: tuple[int, ...], cfg: Mapping[str, Any]):
    """With two LayerNorms ``attn_norm`` is the MLP's (``ln_mlp``) and ``attn_norm_2`` the attention's
    (``ln_attn``), as ``tensor_mapping`` names them; with one it is ``input_layernorm``."""
    if part != "attn_norm" or cfg.get("num_ln_in_parallel_attn") != 2:
        return None
    return Placement((f"transformer.h.{bid}.ln_mlp.{kind}",))


# ---- the tables --------------------------------------------------------------------------------------
_LLAMA_GLOBALS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_ATTENTION = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
              "attn_output": "self_attn.o_proj"}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_GATED_MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_LLAMA_NORMS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
_LLAMA_BLOCKS = {**_LLAMA_NORMS, **_ATTENTION, **_QK_NORMS, **_GATED_MLP, "ffn_gate_inp": "block_sparse_moe.gate"}
_GEMMA2_BLOCKS = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
                  "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
                  **_ATTENTION, **_QK_NORMS, **_GATED_MLP}
_FUSED_GATE_UP = {"ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj"}
_GPT_GLOBALS = {"token_embd": "transformer.word_embeddings", "output_norm": "transformer.ln_f", "output": "lm_head"}
_GPT_BLOCKS = {"attn_norm": "input_layernorm", "attn_qkv": "self_attention.query_key_value",
               "attn_output": "self_attention.dense", "ffn_up": "mlp.dense_h_to_4h", "ffn_down": "mlp.dense_4h_to_h"}

_LLAMA = Layout(_LLAMA_GLOBALS, _LLAMA_BLOCKS, undo=_undo_llama_permute, hook=_mixtral_experts, per_expert=True)
_QWEN = Layout(_LLAMA_GLOBALS, _LLAMA_BLOCKS)
_GEMMA = Layout(_LLAMA_GLOBALS, {**_LLAMA_NORMS, **_ATTENTION, **_GATED_MLP}, undo=_undo_gemma_norms)
_GEMMA2 = Layout(_LLAMA_GLOBALS, _GEMMA2_BLOCKS, undo=_undo_gemma_norms)

# GGUF ``general.architecture`` -> its layout (the architectures of ``shared/gguf_architectures``).
LAYOUTS: dict[str, Layout] = {
    "llama": _LLAMA,
    "qwen2": _QWEN,
    "qwen3": _QWEN,
    "smollm3": Layout(_LLAMA_GLOBALS, {**_LLAMA_NORMS, **_ATTENTION, **_GATED_MLP}, undo=_undo_llama_permute),
    "gemma": _GEMMA,
    "gemma2": _GEMMA2,
    "gemma3": _GEMMA2,
    "phi3": Layout(_LLAMA_GLOBALS, {**_LLAMA_NORMS, **_ATTENTION, "attn_qkv": "self_attn.qkv_proj", **_FUSED_GATE_UP},
                   skip=frozenset({"rope_factors_long.weight", "rope_factors_short.weight"})),
    "olmo2": Layout(_LLAMA_GLOBALS, {**_ATTENTION, **_QK_NORMS, **_GATED_MLP,
                                     "post_attention_norm": "post_attention_layernorm",
                                     "post_ffw_norm": "post_feedforward_layernorm"}),
    "granite": Layout(_LLAMA_GLOBALS, _LLAMA_BLOCKS, undo=_undo_llama_permute),
    "command-r": Layout(_LLAMA_GLOBALS, {"attn_norm": "input_layernorm", **_ATTENTION, **_QK_NORMS, **_GATED_MLP}),
    "glm4": Layout(_LLAMA_GLOBALS, {**_LLAMA_NORMS, **_ATTENTION, **_FUSED_GATE_UP,
                                    "post_attention_norm": "post_self_attn_layernorm",
                                    "post_ffw_norm": "post_mlp_layernorm"}),
    "starcoder2": Layout(_LLAMA_GLOBALS, {**_LLAMA_NORMS, **_ATTENTION, "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"}),
    "stablelm": Layout(_LLAMA_GLOBALS, {**_LLAMA_NORMS, **_ATTENTION, **_GATED_MLP}, hook=_stablelm_qk_norms),
    "phi2": Layout({"token_embd": "model.embed_tokens", "output_norm": "model.final_layernorm", "output": "lm_head"},
                   {"attn_norm": "input_layernorm", **_ATTENTION, "attn_output": "self_attn.dense",
                    "ffn_up": "mlp.fc1", "ffn_down": "mlp.fc2"}, hook=_phi2_fused_qkv),
    "gpt2": Layout({"token_embd": "transformer.wte", "position_embd": "transformer.wpe",
                    "output_norm": "transformer.ln_f", "output": "lm_head"},
                   {"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj", "ffn_norm": "ln_2",
                    "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"},
                   block_prefix="transformer.h.{bid}.", undo=_undo_gpt2_transpose),
    "gptj": Layout({"token_embd": "transformer.wte", "output_norm": "transformer.ln_f", "output": "lm_head"},
                   {"attn_norm": "ln_1", "attn_q": "attn.q_proj", "attn_k": "attn.k_proj", "attn_v": "attn.v_proj",
                    "attn_output": "attn.out_proj", "ffn_up": "mlp.fc_in", "ffn_down": "mlp.fc_out"},
                   block_prefix="transformer.h.{bid}."),
    "gptneox": Layout({"token_embd": "gpt_neox.embed_in", "output_norm": "gpt_neox.final_layer_norm",
                       "output": "embed_out"},
                      {"attn_norm": "input_layernorm", "attn_qkv": "attention.query_key_value",
                       "attn_output": "attention.dense", "ffn_norm": "post_attention_layernorm",
                       "ffn_up": "mlp.dense_h_to_4h", "ffn_down": "mlp.dense_4h_to_h"},
                      block_prefix="gpt_neox.layers.{bid}.", undo=_undo_qkv_per_group),
    "falcon": Layout(_GPT_GLOBALS, {**_GPT_BLOCKS, "attn_norm_2": "ln_attn"}, block_prefix="transformer.h.{bid}.",
                     undo=_undo_qkv_per_group, hook=_falcon_norms),
    "bloom": Layout({**_GPT_GLOBALS, "token_embd_norm": "transformer.word_embeddings_layernorm"},
                    {**_GPT_BLOCKS, "ffn_norm": "post_attention_layernorm"}, block_prefix="transformer.h.{bid}.",
                    undo=_undo_qkv_per_group),
}

