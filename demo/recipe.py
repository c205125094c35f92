"""Deterministic local recipe for small Hugging Face-format checkpoints and their tokenizer.

Nothing here touches the network: the tokenizer is trained on Python's own standard-library
sources and the models are randomly initialised, so tests, benchmarks and examples get real
HF-format folders (``config.json``, ``model.safetensors``, ``generation_config.json`` and the
tokenizer files) that ``AutoTokenizer`` / ``AutoModelForCausalLM`` load with ``HF_HUB_OFFLINE=1``.

Tokenizer
    Byte-level BPE (``tokenizers``): ``ByteLevel`` pre-tokenizer (``add_prefix_space=False``) and
    decoder, trained with ``train_from_iterator`` on a fixed, sorted subset of the stdlib ``*.py``
    files, so ``decode(encode(s)) == s`` for any text. Special tokens have fixed ids::

        <unk>=0  <s>=1 (bos)  </s>=2 (eos)  <pad>=3  <|im_start|>=4  <|im_end|>=5

    It adds **no** BOS/EOS by itself: a plain ``encode`` returns the BPE tokens only (there is no
    post-processor). A ChatML ``chat_template`` is saved with it (``add_generation_prompt`` ends
    the prompt with ``<|im_start|>assistant\\n``).

Checkpoints
    ``ARCHS`` lists the ``(arch, size)`` pairs: llama tiny/small/base, qwen2 tiny, mistral tiny,
    mixtral tiny (MoE: 4 experts, top-2), opt tiny/small and llava tiny (a 2-layer CLIP vision
    tower on 30x30 images, 25 image tokens, before the llama-tiny architecture; ``<image>`` is added
    to the tokenizer and the processor files are saved beside it). Weights are float32, initialised with
    ``torch.manual_seed(0)`` by transformers' default init and then reshaped deterministically so
    that the random models are useful for testing (see :func:`_make_useful`): greedy decoding
    produces varied tokens rather than one repeated token, top logprobs are spread out, and biases /
    norm weights are non-trivial so an engine that drops them disagrees with the reference.
    mistral-tiny (``sliding_window=None``) is the llama-tiny architecture with the same seed, so the
    two hold identical weights and outputs.

Determinism
    Building twice gives byte-identical files for a given environment (Python installation, torch,
    transformers and tokenizers versions); a different Python's stdlib gives a different tokenizer.

Cache
    :func:`ensure_checkpoint` keeps built folders in ``<cache_dir>/<arch>-<size>`` and tokenizers in
    ``<cache_dir>/tokenizer-<vocab>``; ``cache_dir`` defaults to ``$GRIDSERVE_MODEL_CACHE`` or
    ``~/.cache/gridserve/models``. Folders are built in a temporary sibling and renamed into place.
    Their ``.complete`` marker holds :func:`fingerprint` (:data:`RECIPE_VERSION`, a hash of this
    file, the Python / torch / transformers / tokenizers versions); a folder whose fingerprint
    differs is rebuilt, so a changed recipe or environment never reuses stale files.

CLI::

    python -m gridserve.demo.recipe --arch llama --size tiny [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import math
import os
import shutil
import sysconfig
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from gridserve.shared import envs

logger = logging.getLogger(__name__)

#: Bump when the files produced change (a hash of this file is in the cache key too).
RECIPE_VERSION = "2"

MARKER = ".complete"
CACHE_ENV = "GRIDSERVE_MODEL_CACHE"

UNK_TOKEN, BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<unk>", "<s>", "</s>", "<pad>"
IM_START_TOKEN, IM_END_TOKEN = "<|im_start|>", "<|im_end|>"
#: Special tokens in id order: the trainer gives them ids 0..5.
SPECIAL_TOKENS = (UNK_TOKEN, BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, IM_START_TOKEN, IM_END_TOKEN)
UNK_ID, BOS_ID, EOS_ID, PAD_ID, IM_START_ID, IM_END_ID = range(len(SPECIAL_TOKENS))

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{%- set content = message['content'] -%}"
    "{%- else -%}{%- set content = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') -%}{%- endif -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

# Tokenizer training corpus: the sorted top-level stdlib *.py files, up to this many bytes per
# vocabulary entry (at least 1 MB): ~1 MB for 4096 tokens, all ~4.7 MB (Python 3.11) for 32000.
_CORPUS_BYTES_PER_TOKEN = 200
_CORPUS_MIN_BYTES = 1_000_000

# Weight shaping (see _make_useful): std of the decoder's linear weights times sqrt(fan_in), the
# target std of the logits, and the relative noise put on norm weights and zero-initialised biases.
_LINEAR_GAIN = 1.3
_LOGIT_STD = 3.0
_NORM_NOISE = 0.1
_BIAS_STD = 0.02
# Mixtral's router and fused expert weights are plain parameters, not nn.Linear: scaled by name.
_MOE_WEIGHTS = ("mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj")

_TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
         "vocab_size": 4096}
_SMALL = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
          "vocab_size": 4096}
_BASE = {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
         "num_attention_heads": 12, "num_key_value_heads": 12, "max_position_embeddings": 2048,
         "vocab_size": 32000}

#: (arch, size) -> config keyword arguments (before the special-token ids).
ARCHS: dict[tuple[str, str], dict[str, Any]] = {
    ("llama", "tiny"): {**_TINY, "rms_norm_eps": 1e-6, "tie_word_embeddings": False},
    ("llama", "small"): {**_SMALL, "rms_norm_eps": 1e-6, "tie_word_embeddings": False},
    ("llama", "base"): {**_BASE, "rms_norm_eps": 1e-6, "tie_word_embeddings": False},
    ("qwen2", "tiny"): {**_TINY, "rms_norm_eps": 1e-6, "tie_word_embeddings": True},
    ("mistral", "tiny"): {**_TINY, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                          "sliding_window": None},
    ("mixtral", "tiny"): {**_TINY, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                          "sliding_window": None, "num_local_experts": 4, "num_experts_per_tok": 2},
    ("llava", "tiny"): {**_TINY, "rms_norm_eps": 1e-6, "tie_word_embeddings": False},
    ("opt", "tiny"): {"hidden_size": 64, "ffn_dim": 128, "num_hidden_layers": 2,
                      "num_attention_heads": 4, "max_position_embeddings": 512,
                      "word_embed_proj_dim": 64, "vocab_size": 4096},
    ("opt", "small"): {"hidden_size": 256, "ffn_dim": 1024, "num_hidden_layers": 4,
                       "num_attention_heads": 4, "max_position_embeddings": 2048,
                       "word_embed_proj_dim": 256, "vocab_size": 4096},
}
# Llava: a tiny CLIP vision tower (a 30x30 image in 6x6 patches: 25 image tokens, the CLS token
# dropped) before the tiny Llama; its image processor resizes the shortest edge to 32 and crops 30x30.
IMAGE_TOKEN = "<image>"
_CLIP_TINY = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "image_size": 30, "patch_size": 6, "projection_dim": 32}
_CLIP_PROCESSOR = {"size": {"shortest_edge": 32}, "crop_size": {"height": 30, "width": 30}}
LLAVA_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{{ part['text'] }}"
    "{%- elif part['type'] in ('image', 'image_url') -%}{{ '<image>' }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<|im_end|>' + '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
_OPT_FIXED = {"do_layer_norm_before": True, "dropout": 0.0, "attention_dropout": 0.0,
              "activation_dropout": 0.0, "layerdrop": 0.0, "tie_word_embeddings": True}


def default_cache_dir() -> Path:
    """``$GRIDSERVE_MODEL_CACHE`` if set, else ``~/.cache/gridserve/models``."""
    env = envs.GRIDSERVE_MODEL_CACHE
    return Path(env).expanduser() if env else Path.home() / ".cache" / "gridserve" / "models"


# --------------------------------------------------------------------------------------------
# Tokenizer


def _corpus_files(max_bytes: int) -> list[Path]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files: list[Path] = []
    total = 0
    for path in sorted(stdlib.glob("*.py")):
        if total >= max_bytes:
            break
        files.append(path)
        total += path.stat().st_size
    if not files:
        raise RuntimeError(f"no *.py files under the stdlib folder {stdlib} to train a tokenizer on")
    return files


def _corpus(files: Sequence[Path]) -> Iterator[str]:
    for path in files:
        yield path.read_text(encoding="utf-8", errors="ignore")


def build_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """Train the byte-level BPE tokenizer with ``vocab_size`` tokens and save it into ``out_dir``.

    The saved folder loads with ``AutoTokenizer.from_pretrained(out_dir)``; encoding adds no BOS.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    start = time.perf_counter()
    files = _corpus_files(max(_CORPUS_MIN_BYTES, _CORPUS_BYTES_PER_TOKEN * vocab_size))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(files), trainer=trainer)
    for i, token in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(token) != i:
            raise RuntimeError(f"special token {token!r} got id {tok.token_to_id(token)}, not {i}")

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token=UNK_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START_TOKEN, IM_END_TOKEN],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    hf_tok.save_pretrained(str(out_dir))
    _portable_tokenizer_config(out_dir)
    logger.info(
        "trained a %d-token byte-level BPE tokenizer on %d stdlib files in %.1fs -> %s",
        tok.get_vocab_size(), len(files), time.perf_counter() - start, out_dir,
    )


def _portable_tokenizer_config(folder: Path, model_max_length: int | None = None) -> None:
    """Rewrite ``tokenizer_config.json`` in the form transformers 4.x and 5.x both load.

    transformers 5 saves ``tokenizer_class: TokenizersBackend`` and ``extra_special_tokens``, which
    4.x does not know; ``PreTrainedTokenizerFast`` and ``additional_special_tokens`` load in both.
    """
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config.pop("backend", None)
    config.pop("extra_special_tokens", None)
    config["additional_special_tokens"] = [IM_START_TOKEN, IM_END_TOKEN]
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    if model_max_length is not None:
        config["model_max_length"] = model_max_length
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------------------------
# Models


def _recipe(arch: str, size: str) -> dict[str, Any]:
    try:
        return dict(ARCHS[(arch, size)])
    except KeyError:
        known = ", ".join(f"{a}/{s}" for a, s in ARCHS)
        raise ValueError(f"no recipe for arch {arch!r} size {size!r} (known: {known})") from None


def _make_config(arch: str, size: str) -> Any:
    kwargs = _recipe(arch, size)
    ids = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID}
    if arch == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(**kwargs, **ids)
    if arch == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(**kwargs, **ids)
    if arch == "mistral":
        from transformers import MistralConfig

        return MistralConfig(**kwargs, **ids)
    if arch == "mixtral":
        from transformers import MixtralConfig

        return MixtralConfig(**kwargs, **ids)
    if arch == "llava":
        from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig

        patches = (_CLIP_TINY["image_size"] // _CLIP_TINY["patch_size"]) ** 2
        return LlavaConfig(vision_config=CLIPVisionConfig(**_CLIP_TINY), text_config=LlamaConfig(**kwargs, **ids),
                           image_seq_length=patches, tie_word_embeddings=False)
    if arch == "opt":
        from transformers import OPTConfig

        return OPTConfig(**kwargs, **_OPT_FIXED, **ids)
    raise ValueError(f"unknown arch {arch!r}")  # pragma: no cover - ARCHS covers every arch


def _final_norm(model: Any) -> Any:
    inner = model.model
    if hasattr(inner, "language_model"):  # Llava
        return inner.language_model.norm
    if hasattr(inner, "decoder"):  # OPT
        return inner.decoder.final_layer_norm
    return inner.norm


def _make_useful(model: Any, init_std: float) -> None:
    """Reshape the default (std ``init_std``) random init into a more useful test model.

    With the default init every layer adds little to the residual stream, so the last hidden state
    is mostly the input embedding: an untied model then maps each token to a fixed next token,
    and a tied one (qwen2, opt) greedily repeats its last token forever; logits are also nearly
    uniform (std ~0.16). So, deterministically (plain float multiplies, seeded noise):

    * the decoder's linear weights (and Mixtral's router and experts) are scaled to std
      ``_LINEAR_GAIN / sqrt(fan_in)``, so attention and MLP outputs dominate the embedding and next
      tokens depend on the context (and router logits are spread, so top-k rarely ties);
    * the final norm's weight is scaled so the logits have std ~``_LOGIT_STD`` (top logprobs are
      well separated; scaling the norm rather than the lm_head leaves tied input embeddings alone);
    * norm weights get ``1 + N(0, _NORM_NOISE)`` and zero biases ``N(0, _BIAS_STD)`` so that a
      kernel that ignores them gives a different answer than the reference.
    """
    import torch

    lm_head = model.get_output_embeddings()
    hidden = model.config.get_text_config().hidden_size
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module is not lm_head:
                module.weight.mul_(_LINEAR_GAIN / (init_std * math.sqrt(module.in_features)))
            elif isinstance(module, torch.nn.Conv2d):  # a vision tower's patch embedding
                fan_in = module.weight[0].numel()
                module.weight.normal_(0.0, 1.0).mul_(_LINEAR_GAIN / math.sqrt(fan_in))
        for name, param in model.named_parameters():
            if name.endswith(_MOE_WEIGHTS):  # [..., out, in]: fan_in is the last dim
                param.mul_(_LINEAR_GAIN / (init_std * math.sqrt(param.shape[-1])))
            elif name.endswith("bias"):
                param.normal_(0.0, _BIAS_STD)
            elif "norm" in name and param.dim() == 1:
                param.add_(torch.randn_like(param), alpha=_NORM_NOISE)
        _final_norm(model).weight.mul_(_LOGIT_STD / (init_std * math.sqrt(hidden)))


def _add_image_token(folder: Path) -> int:
    """Add ``<image>`` as a special token of the tokenizer in ``folder``; return its id."""
    from tokenizers import AddedToken, Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(IMAGE_TOKEN, special=True, normalized=False)])
    tok.save(str(folder / "tokenizer.json"))
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config["additional_special_tokens"] = [*config["additional_special_tokens"], IMAGE_TOKEN]
    config["chat_template"] = LLAVA_CHAT_TEMPLATE
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    return tok.token_to_id(IMAGE_TOKEN)


def _save_llava_processor(folder: Path, config: Any) -> None:
    """``preprocessor_config.json`` (CLIP's PIL image processor) and ``processor_config.json``."""
    from transformers import AutoTokenizer, CLIPImageProcessorPil, LlavaProcessor

    vision = config.vision_config
    images = CLIPImageProcessorPil(**_CLIP_PROCESSOR)
    processor = LlavaProcessor(image_processor=images, tokenizer=AutoTokenizer.from_pretrained(str(folder)),
                               patch_size=vision.patch_size, num_additional_image_tokens=1,
                               vision_feature_select_strategy=config.vision_feature_select_strategy,
                               image_token=IMAGE_TOKEN, chat_template=LLAVA_CHAT_TEMPLATE)
    processor.save_pretrained(str(folder))
    images.save_pretrained(str(folder))  # preprocessor_config.json, as transformers 4.x wrote it
    _portable_tokenizer_config(folder)
    path = folder / "tokenizer_config.json"
    tok_config = json.loads(path.read_text(encoding="utf-8"))
    tok_config["additional_special_tokens"] = [IM_START_TOKEN, IM_END_TOKEN, IMAGE_TOKEN]
    tok_config["chat_template"] = LLAVA_CHAT_TEMPLATE
    path.write_text(json.dumps(tok_config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _tokenizer_vocab_size(tokenizer_dir: Path) -> int:
    data = json.loads((tokenizer_dir / "tokenizer.json").read_text(encoding="utf-8"))
    ids = list(data["model"]["vocab"].values()) + [t["id"] for t in data.get("added_tokens", [])]
    return max(ids) + 1


def build_checkpoint(
    out_dir: Path, arch: str, size: str, *, tokenizer_dir: Path | None = None
) -> Path:
    """Build the ``arch``/``size`` checkpoint into ``out_dir`` (created) and return ``out_dir``.

    Writes ``config.json``, ``model.safetensors`` (float32), ``generation_config.json`` and the
    tokenizer files. The tokenizer is copied from ``tokenizer_dir`` (a :func:`build_tokenizer`
    folder of the right vocab size) or, without it, trained into ``out_dir``.
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    out_dir = Path(out_dir)
    config = _make_config(arch, size)
    start = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    if tokenizer_dir is None:
        build_tokenizer(out_dir, config.vocab_size)
    else:
        for path in sorted(Path(tokenizer_dir).iterdir()):
            if path.is_file() and path.name != MARKER:
                shutil.copyfile(path, out_dir / path.name)
    text_config = config.get_text_config()
    _portable_tokenizer_config(out_dir, model_max_length=text_config.max_position_embeddings)
    if arch == "llava":
        config.image_token_index = _add_image_token(out_dir)
    # The model vocab may exceed the tokenizer's (if BPE training ran out of merges), never less.
    text_config.vocab_size = max(text_config.vocab_size, _tokenizer_vocab_size(out_dir))

    init_std = float(getattr(config, "initializer_range", getattr(config, "init_std", 0.02)))
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)  # init in float32 whatever the caller's default
    try:
        torch.manual_seed(0)
        if arch == "llava":
            from transformers import LlavaForConditionalGeneration

            model = LlavaForConditionalGeneration(config).to(torch.float32).eval()
        else:
            model = AutoModelForCausalLM.from_config(config).to(torch.float32).eval()
    finally:
        torch.set_default_dtype(default_dtype)
    _make_useful(model, init_std)
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID
    )
    model.save_pretrained(str(out_dir))
    if arch == "llava":
        _save_llava_processor(out_dir, config)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info(
        "built %s-%s (%.1fM parameters, vocab %d) in %.1fs -> %s",
        arch, size, n_params / 1e6, text_config.vocab_size, time.perf_counter() - start, out_dir,
    )
    return out_dir


# --------------------------------------------------------------------------------------------
# Cache


def fingerprint() -> dict[str, str]:
    """What a cached folder was built by: recipe version and source hash, Python and library versions.

    Each of these can change the bytes built (the stdlib corpus, torch's RNG, transformers' init).
    """
    import platform
    from importlib import metadata

    fp = {
        "recipe": RECIPE_VERSION,
        "source": hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16],
        "python": platform.python_version(),
    }
    for dist in ("torch", "transformers", "tokenizers"):
        try:
            fp[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            fp[dist] = "none"
    return fp


def _is_current(folder: Path) -> bool:
    fp = fingerprint()
    try:
        marker = json.loads((folder / MARKER).read_text(encoding="utf-8"))
        return {k: marker.get(k) for k in fp} == fp
    except (OSError, ValueError, AttributeError):
        return False


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` (POSIX ``flock``; elsewhere no lock: builds are atomic)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    with open(path, "a+b") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _ensure(target: Path, build: Any, info: dict[str, Any]) -> Path:
    """Return ``target``, building it with ``build(tmp_dir)`` unless it is complete and current."""
    if _is_current(target):
        return target
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    with _lock(parent / f".{target.name}.lock"):
        if _is_current(target):  # another process built it while we waited
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=parent))
        try:
            build(tmp)
            marker = {**info, **fingerprint()}
            (tmp / MARKER).write_text(json.dumps(marker, sort_keys=True) + "\n", encoding="utf-8")
            # mkdtemp makes a private (0700) folder; a cache is readable like any other download.
            for path in tmp.iterdir():
                path.chmod(0o644)
            tmp.chmod(0o755)
            stale = None
            if target.exists():
                stale = Path(tempfile.mkdtemp(prefix=f".{target.name}.stale-", dir=parent))
                os.replace(target, stale / target.name)
            os.replace(tmp, target)
            if stale is not None:
                shutil.rmtree(stale, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def ensure_tokenizer(vocab_size: int, cache_dir: Path | None = None) -> Path:
    """Return the cached ``<cache_dir>/tokenizer-<vocab_size>`` folder, training it if missing."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    return _ensure(
        cache / f"tokenizer-{vocab_size}",
        lambda tmp: build_tokenizer(tmp, vocab_size),
        {"vocab_size": vocab_size},
    )


def ensure_checkpoint(arch: str = "llama", size: str = "tiny", cache_dir: Path | None = None) -> Path:
    """Return the cached ``<cache_dir>/<arch>-<size>`` checkpoint folder, building it if missing.

    ``cache_dir`` defaults to :func:`default_cache_dir`. A folder whose ``.complete`` marker holds
    another :func:`fingerprint` (recipe or environment changed) is rebuilt.
    """
    vocab_size = _recipe(arch, size)["vocab_size"]  # ValueError for an unknown arch/size
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    tok_dir = ensure_tokenizer(vocab_size, cache)
    return _ensure(
        cache / f"{arch}-{size}",
        lambda tmp: build_checkpoint(tmp, arch, size, tokenizer_dir=tok_dir),
        {"arch": arch, "size": size},
    )


def main(argv: Sequence[str] | None = None) -> None:
    """CLI: build (or find) a cached checkpoint and print its folder."""
    archs = sorted({a for a, _ in ARCHS})
    sizes = sorted({s for _, s in ARCHS})
    parser = argparse.ArgumentParser(
        prog="python -m gridserve.demo.recipe",
        description="Build a small random HF-format checkpoint (and tokenizer) deterministically.",
    )
    parser.add_argument("--arch", default="llama", choices=archs)
    parser.add_argument("--size", default="tiny", choices=sizes)
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help=f"cache folder (default: ${CACHE_ENV} or ~/.cache/gridserve/models)")
    args = parser.parse_args(argv)
    if (args.arch, args.size) not in ARCHS:
        known = ", ".join(f"{a}/{s}" for a, s in ARCHS)
        parser.error(f"no recipe for {args.arch}/{args.size} (known: {known})")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    print(ensure_checkpoint(args.arch, args.size, args.cache_dir))


if __name__ == "__main__":
    main()
