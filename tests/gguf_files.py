"""Tiny GGUF files for the tests: a recipe checkpoint (safetensors + tokenizer.json) written with the
``gguf`` package's writer the way llama.cpp's ``convert_hf_to_gguf.py`` lays it out (names, Q/K row
permutation for llama, byte-level BPE vocabulary with token types)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import numpy as np

_BLOCK_PARTS = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


_EXPERT_PARTS = {"w1": "ffn_gate", "w3": "ffn_up", "w2": "ffn_down"}


def gguf_name(hf_name: str) -> str:
    globals_ = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
    if hf_name in globals_:
        return globals_[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    if rest == "block_sparse_moe.gate.weight":
        return f"blk.{layer}.ffn_gate_inp.weight"
    part, _, kind = rest.rpartition(".")
    return f"blk.{layer}.{_BLOCK_PARTS[part]}.{kind}"


def permute_qk(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: HF's rotary halves -> interleaved pairs."""
    shape = weights.shape
    return (weights.reshape(n_head, 2, shape[0] // n_head // 2, *shape[1:]).swapaxes(1, 2)
            .reshape(shape))


def hf_tokenizer_fields(tokenizer_json: dict) -> tuple[list[str], list[int], list[str]]:
    """tokens, token types (1 normal, 3 control, 4 user-defined) and merges of a byte-level BPE."""
    import gguf

    vocab = tokenizer_json["model"]["vocab"]
    added = {t["id"]: t for t in tokenizer_json["added_tokens"]}
    size = max(max(vocab.values()), max(added, default=-1)) + 1
    tokens = [""] * size
    types = [int(gguf.TokenType.NORMAL)] * size
    for text, i in vocab.items():
        tokens[i] = text
    for i, tok in added.items():
        tokens[i] = tok["content"]
        types[i] = int(gguf.TokenType.CONTROL if tok["special"] else gguf.TokenType.USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer_json["model"]["merges"]]
    return tokens, types, merges


def write_gguf(folder: Path, out: Path, tensor_type: str = "F32", pre: str = "gpt2",
               tokenizer_json: Optional[dict] = None, arch: Optional[str] = None,
               add_bos: Optional[bool] = False,
               sentencepiece: Optional[tuple[list[str], list[float], list[int]]] = None) -> Path:
    """Write the checkpoint in ``folder`` as the GGUF file ``out`` (weights as ``tensor_type``:
    F32, F16, BF16, Q8_0, Q4_0 or Q4_1 for the 2-D ones; 1-D tensors stay F32, as llama.cpp does)."""
    import gguf
    from safetensors.numpy import load_file

    config = json.loads((folder / "config.json").read_text())
    arch = arch or {"mixtral": "llama", "mistral": "llama"}.get(config["model_type"], config["model_type"])
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config.get("rope_parameters", {}).get("rope_theta", 10000.0))
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if "num_local_experts" in config:
        writer.add_expert_count(config["num_local_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
    if sentencepiece is not None:  # ("llama": tokens, scores, types; no merges, like llama.cpp's files)
        tokens, scores, types = sentencepiece
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        writer.add_unk_token_id(0)
    else:
        tok = tokenizer_json or json.loads((folder / "tokenizer.json").read_text())
        tokens, types, merges = hf_tokenizer_fields(tok)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_pad_token_id(config["pad_token_id"])
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    template = folder / "chat_template.jinja"
    writer.add_chat_template(template.read_text() if template.is_file() else tok_config["chat_template"])

    qtype = gguf.GGMLQuantizationType[tensor_type]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    tensors = {name: value.astype(np.float32) for name, value in load_file(str(folder / "model.safetensors")).items()}
    _stack_experts(tensors)
    for name, value in sorted(tensors.items()):
        if arch == "llama" and ".self_attn.q_proj." in name:
            value = permute_qk(value, heads)
        elif arch == "llama" and ".self_attn.k_proj." in name:
            value = permute_qk(value, kv_heads)
        target = name if name.startswith("blk.") else gguf_name(name)
        if value.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(target, value)
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(target, value.astype(np.float16))
        else:
            writer.add_tensor(target, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def _stack_experts(tensors: dict[str, np.ndarray]) -> None:
    """Mixtral's per-expert w1 / w3 / w2 -> llama.cpp's stacked ``blk.N.ffn_{gate,up,down}_exps``."""
    import re

    pattern = re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$")
    groups: dict[tuple[str, str], dict[int, str]] = {}
    for name in list(tensors):
        match = pattern.match(name)
        if match:
            groups.setdefault((match[1], match[3]), {})[int(match[2])] = name
    for (layer, proj), names in groups.items():
        stacked = np.stack([tensors.pop(names[e]) for e in sorted(names)])
        tensors[f"blk.{layer}.{_EXPERT_PARTS[proj]}_exps.weight"] = stacked


def sentencepiece_vocab(texts: list[str], size: int = 1200) -> tuple[list[str], list[float], list[int]]:
    """A llama-style SentencePiece BPE vocabulary (tokens, scores, token types) trained on ``texts``:
    ``<unk>`` ``<s>`` ``</s>``, then ``<pad>``, the 256 ``<0xNN>`` byte tokens, then the pieces (U+2581 for
    a space) scored ``-rank``, as llama.cpp's converter writes a ``tokenizer.model``'s."""
    import gguf
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=True)
    special = ["<unk>", "<s>", "</s>", "<pad>"] + [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=size, special_tokens=special, show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    vocab = sorted(tok.get_vocab().items(), key=lambda item: item[1])
    tokens = [text for text, _ in vocab]
    types = [int(gguf.TokenType.NORMAL)] * len(tokens)
    types[0] = int(gguf.TokenType.UNKNOWN)
    types[1] = types[2] = types[3] = int(gguf.TokenType.CONTROL)
    for i in range(4, 260):
        types[i] = int(gguf.TokenType.BYTE)
    scores = [0.0] * 260 + [-float(i) for i in range(len(tokens) - 260)]
    return tokens, scores, types
