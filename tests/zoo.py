"""Tiny random checkpoints of any Hugging Face architecture, built with transformers' own class.

``zoo_checkpoint("qwen3-gqa", "Qwen3Config", hidden_size=64, ...)`` returns a cached folder
(``<model cache>/zoo/<name>``) holding config.json, model.safetensors and the recipe's tiny
tokenizer (vocab 4096). The random init is reshaped as the recipe does (``_make_useful``-like):
linear weights scaled so each layer matters, norm weights and biases perturbed so a kernel that
ignores them gives another answer, and the logits spread (std ~3) so greedy tokens are decisive.
A folder is rebuilt when its name's config, this file or the libraries change.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path
from typing import Any

from gridserve.demo import recipe

VOCAB = 4096
_GAIN = 1.3
_LOGIT_STD = 3.0
_NOISE = 0.1
_BIAS_STD = 0.02
# names of the final norm across architectures (the module before the LM head)
_FINAL_NORMS = ("norm", "final_layernorm", "final_layer_norm", "ln_f", "norm_f", "final_norm")


def zoo_checkpoint(name: str, config_class: str, seed: int = 0, norm_offset: float = 0.0, **config: Any) -> Path:
    """The cached tiny checkpoint ``name`` of ``transformers.<config_class>(**config)``.

    ``norm_offset``: what the architecture's norms add to their weight (Gemma's ``1 + w``: 1.0), so
    the logit spread scales the effective weight ``offset + w`` of the final norm.
    """
    config = {"vocab_size": VOCAB, **config}
    keyed = [config_class, seed, config] + ([norm_offset] if norm_offset else [])
    key = hashlib.sha256(json.dumps(keyed, sort_keys=True, default=str).encode()
                         + Path(__file__).read_bytes()).hexdigest()[:12]
    cache = recipe.default_cache_dir()
    tokenizer = recipe.ensure_tokenizer(VOCAB, cache)
    return recipe._ensure(cache / "zoo" / f"{name}-{key}",
                          lambda tmp: _build(tmp, config_class, seed, config, tokenizer, norm_offset),
                          {"zoo": name, "config_class": config_class})


def _build(out: Path, config_class: str, seed: int, config: dict, tokenizer: Path, norm_offset: float = 0.0) -> None:
    import torch
    import transformers

    special = {"bos_token_id": recipe.BOS_ID, "eos_token_id": recipe.EOS_ID, "pad_token_id": recipe.PAD_ID}
    hf_config = getattr(transformers, config_class)(**{**special, **config})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    _spread(model, norm_offset)
    model.save_pretrained(out, safe_serialization=True)
    for path in tokenizer.iterdir():
        if path.is_file() and path.name != recipe.MARKER:
            shutil.copy(path, out / path.name)


def _spread(model, norm_offset: float = 0.0) -> None:
    import torch

    head = model.get_output_embeddings()
    hidden = model.config.get_text_config().hidden_size
    std = getattr(model.config, "initializer_range", 0.02) or 0.02
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module is not head:
                module.weight.normal_(0.0, _GAIN / math.sqrt(module.in_features))
            elif type(module).__name__ == "Conv1D":  # GPT-2: weight is (in, out)
                module.weight.normal_(0.0, _GAIN / math.sqrt(module.weight.shape[0]))
        for pname, param in model.named_parameters():
            if pname.endswith("bias"):
                param.normal_(0.0, _BIAS_STD)
            elif ("norm" in pname or "ln" in pname.split(".")[-2:][0]) and param.dim() == 1:
                param.add_(torch.randn_like(param), alpha=_NOISE)
        final = _final_norm(model)
        if final is not None and getattr(final, "weight", None) is not None:
            final.weight.add_(norm_offset).mul_(_LOGIT_STD / (std * math.sqrt(hidden))).sub_(norm_offset)
        elif head is not None:
            head.weight.mul_(_LOGIT_STD / (std * math.sqrt(hidden)))


def _final_norm(model):
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    for owner in (decoder, getattr(model, "model", None), getattr(model, "transformer", None)):
        for attr in _FINAL_NORMS:
            if owner is not None and hasattr(owner, attr):
                return getattr(owner, attr)
    return None


def edited_checkpoint(src: Path, suffix: str, edit: Any) -> Path:
    """A copy of checkpoint ``src`` (cached beside it as ``<src><suffix>``) after ``edit(tensors,
    config)`` changed its tensors (name -> tensor) and config.json (a dict) in place: values
    transformers initialises to zero (sinks, correction biases) made to matter, extra tensors."""
    from safetensors.torch import load_file, save_file

    dst = src.with_name(src.name + suffix)
    if (dst / "model.safetensors").exists():
        return dst
    tmp = src.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    tensors = load_file(str(src / "model.safetensors"))
    config = json.loads((tmp / "config.json").read_text())
    edit(tensors, config)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config))
    shutil.rmtree(dst, ignore_errors=True)
    tmp.rename(dst)
    return dst


def peft_adapter(base: Path, folder: Path, targets: list[str], rank: int = 8, seed: int = 1, **lora: Any) -> Path:
    """A random LoRA adapter of checkpoint ``base``, saved into ``folder`` as PEFT saves it
    (``adapter_config.json`` + ``adapter_model.safetensors``). ``init_lora_weights=False``: PEFT's
    default makes B = 0, which any fake passes; ``lora`` are more ``peft.LoraConfig`` fields."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    if (folder / "adapter_model.safetensors").exists():
        return folder
    config = peft.LoraConfig(r=rank, lora_alpha=lora.pop("lora_alpha", 2 * rank), target_modules=targets,
                             init_lora_weights=False, **lora)
    torch.manual_seed(seed)
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), config)
    model.save_pretrained(folder)
    return folder
