"""The trained demo model: a small Llama that has learned Python from the standard library.

The recipe's checkpoints (:mod:`gridserve.demo.recipe`) have random weights, so a server that
answers with them cannot be told from a broken one. This module trains the same kind of folder on
:mod:`gridserve.demo.corpus`'s training files, with plain torch, in a few minutes on two CPU cores:

Model
    ``LlamaForCausalLM`` from :class:`TrainConfig` (by default hidden 256, 4 layers, 4 heads / 2
    KV heads, MLP 688, untied LM head, about 5M parameters) with the recipe's 4096-token BPE
    tokenizer; initialised by transformers' default init after ``torch.manual_seed(seed)``.

Training
    The training documents (BOS + tokens per file) are packed into one token stream; each step
    takes ``batch_size`` windows of ``seq_len + 1`` tokens at offsets drawn from a
    ``torch.Generator`` seeded with ``seed``, so the data order is fixed. Next-token cross
    entropy, AdamW (betas 0.9 / 0.95, weight decay on matrices only), linear warm-up then cosine
    decay to ``min_lr_ratio`` of the peak, gradient clipping. Same seed, same corpus, same
    torch build and thread count -> bit-identical weights.

Output
    A normal HF Llama folder (``save_pretrained(safe_serialization=True)``: ``config.json``,
    ``model.safetensors``, ``generation_config.json``, tokenizer files) plus ``training.json``
    (config, parameter count, tokens, wall time, tokens/s, loss curve). ``steps=0`` saves the
    untrained initialisation of the same architecture, the baseline for perplexity.

Cache
    :func:`ensure_demo_model` keeps the folder in ``<cache_dir>/demo-llama`` (cache as in the
    recipe), built in a temporary sibling and renamed into place; its ``.complete`` marker holds
    :func:`fingerprint` (the recipe's plus hashes of this module, the corpus module and the config)
    and a folder whose fingerprint differs is rebuilt.

CLI::

    python -m gridserve.demo.train [--force] [--cache-dir DIR] [--output DIR] [--steps N]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gridserve.demo import corpus, recipe

logger = logging.getLogger(__name__)

DEMO_NAME = "demo-llama"
TRAINING_INFO = "training.json"


@dataclass(frozen=True)
class TrainConfig:
    """Architecture, optimisation and data of a demo-model run (defaults: the served demo model)."""

    hidden_size: int = 256
    intermediate_size: int = 688
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 1024
    vocab_size: int = 4096
    seq_len: int = 256
    batch_size: int = 8
    steps: int = 600
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    #: Train on only the first N training files (tests); None: all of them.
    max_files: int | None = None

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_hidden_layers", "seq_len", "batch_size", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be at least 1, got {getattr(self, name)}")
        if self.steps < 0:
            raise ValueError(f"TrainConfig.steps must be non-negative, got {self.steps}")
        if self.seq_len > self.max_position_embeddings:
            raise ValueError(f"TrainConfig.seq_len ({self.seq_len}) exceeds max_position_embeddings "
                             f"({self.max_position_embeddings})")
        if self.max_files is not None and self.max_files < 1:
            raise ValueError(f"TrainConfig.max_files must be at least 1, got {self.max_files}")

    def learning_rate(self, step: int) -> float:
        """Linear warm-up over ``warmup_steps``, then cosine decay to ``min_lr_ratio * lr``."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        span = max(1, self.steps - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        floor = self.min_lr_ratio * self.lr
        return floor + 0.5 * (self.lr - floor) * (1.0 + math.cos(math.pi * progress))


@dataclass
class TrainResult:
    """What a run did: the model, its size and the measured speed and losses."""

    model: Any
    num_parameters: int
    num_train_tokens: int
    tokens_seen: int
    wall_s: float
    losses: list[float]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_seen / self.wall_s if self.wall_s > 0 else 0.0

    def summary(self, config: TrainConfig) -> dict[str, Any]:
        return {
            "config": dataclasses.asdict(config),
            "num_parameters": self.num_parameters,
            "num_train_tokens": self.num_train_tokens,
            "tokens_seen": self.tokens_seen,
            "wall_s": round(self.wall_s, 2),
            "tokens_per_s": round(self.tokens_per_s, 1),
            "first_loss": self.losses[0] if self.losses else None,
            "final_loss": _tail_mean(self.losses),
            "losses": [round(x, 4) for x in self.losses],
        }


def model_config(config: TrainConfig) -> Any:
    """The ``LlamaConfig`` of ``config`` (the recipe's special-token ids)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        max_position_embeddings=config.max_position_embeddings, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=recipe.BOS_ID, eos_token_id=recipe.EOS_ID,
        pad_token_id=recipe.PAD_ID,
    )


def training_stream(tokenizer_dir: Path, config: TrainConfig) -> Any:
    """The training files as one int64 token tensor (documents packed, each starting with BOS)."""
    import torch
    from tokenizers import Tokenizer

    files = corpus.train_files()
    if config.max_files is not None:
        files = files[: config.max_files]
    tokenizer = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    docs = corpus.encode_documents(tokenizer, files, recipe.BOS_ID)
    stream = torch.tensor([t for doc in docs for t in doc], dtype=torch.int64)
    if stream.numel() <= config.seq_len + 1:
        raise ValueError(f"{len(files)} training files hold {stream.numel()} tokens: fewer than "
                         f"one window of seq_len + 1 = {config.seq_len + 1}")
    logger.info("training corpus: %d files, %d tokens", len(files), stream.numel())
    return stream


def train(tokenizer_dir: Path, config: TrainConfig = TrainConfig(), *,
          progress: bool = True) -> TrainResult:
    """Train a demo model as :class:`TrainConfig` says and return it (in eval mode, float32)."""
    import torch
    from tqdm.auto import tqdm
    from transformers import LlamaForCausalLM

    stream = training_stream(tokenizer_dir, config)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        torch.manual_seed(config.seed)
        model = LlamaForCausalLM(model_config(config)).to(torch.float32)
    finally:
        torch.set_default_dtype(default_dtype)
    num_parameters = sum(p.numel() for p in model.parameters())
    logger.info("demo model: %.2fM parameters", num_parameters / 1e6)

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=config.lr, betas=(0.9, 0.95), eps=1e-8,
    )
    generator = torch.Generator().manual_seed(config.seed)
    offsets = torch.arange(config.seq_len + 1)
    tokens_per_step = config.batch_size * config.seq_len
    losses: list[float] = []
    model.train()
    start = time.perf_counter()
    bar = tqdm(range(config.steps), desc="Training demo model", unit="step", disable=not progress)
    for step in bar:
        starts = torch.randint(0, stream.numel() - config.seq_len - 1, (config.batch_size, 1),
                               generator=generator)
        batch = stream[starts + offsets]
        for group in optimizer.param_groups:
            group["lr"] = config.learning_rate(step)
        logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 batch[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        losses.append(loss.item())
        elapsed = time.perf_counter() - start
        bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{tokens_per_step * (step + 1) / elapsed:.0f}")
    wall_s = time.perf_counter() - start
    model.eval()
    result = TrainResult(model, num_parameters, stream.numel(), tokens_per_step * config.steps,
                         wall_s, losses)
    if config.steps:
        logger.info("trained %d steps (%d tokens) in %.1fs: %.0f tokens/s, loss %.3f -> %.3f",
                    config.steps, result.tokens_seen, wall_s, result.tokens_per_s, losses[0],
                    _tail_mean(losses))
    return result


def _tail_mean(losses: list[float], n: int = 20) -> float | None:
    tail = losses[-n:]
    return sum(tail) / len(tail) if tail else None


def build_demo_model(out_dir: Path, config: TrainConfig = TrainConfig(), *,
                     tokenizer_dir: Path | None = None, progress: bool = True) -> Path:
    """Train and save the demo model into ``out_dir`` (created); return ``out_dir``."""
    from transformers import GenerationConfig

    out_dir = Path(out_dir)
    tokenizer_dir = Path(tokenizer_dir or recipe.ensure_tokenizer(config.vocab_size))
    result = train(tokenizer_dir, config, progress=progress)
    out_dir.mkdir(parents=True, exist_ok=True)
    for path in sorted(tokenizer_dir.iterdir()):
        if path.is_file() and path.name != recipe.MARKER:
            shutil.copyfile(path, out_dir / path.name)
    recipe._portable_tokenizer_config(out_dir, model_max_length=config.max_position_embeddings)
    result.model.generation_config = GenerationConfig(
        bos_token_id=recipe.BOS_ID, eos_token_id=recipe.EOS_ID, pad_token_id=recipe.PAD_ID
    )
    result.model.save_pretrained(str(out_dir), safe_serialization=True)
    info = result.summary(config)
    info["heldout_files"] = [corpus.relative_name(p) for p in corpus.heldout_files()]
    (out_dir / TRAINING_INFO).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    return out_dir


def fingerprint(config: TrainConfig) -> dict[str, str]:
    """The recipe's fingerprint plus hashes of the trainer, the corpus split and ``config``."""
    sources = hashlib.sha256()
    for module in (__file__, corpus.__file__):
        sources.update(Path(module).read_bytes())
    config_hash = hashlib.sha256(json.dumps(dataclasses.asdict(config), sort_keys=True).encode())
    return {**recipe.fingerprint(), "trainer": sources.hexdigest()[:16],
            "train_config": config_hash.hexdigest()[:16]}


def _is_current(folder: Path, config: TrainConfig) -> bool:
    try:
        marker = json.loads((folder / recipe.MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    expected = fingerprint(config)
    return isinstance(marker, dict) and {k: marker.get(k) for k in expected} == expected


def cache_name(config: TrainConfig) -> str:
    """The cache folder's name: ``demo-llama``, ``demo-llama-untrained`` (``steps=0``) or hashed."""
    if config == TrainConfig():
        return DEMO_NAME
    if config == dataclasses.replace(TrainConfig(), steps=0):
        return f"{DEMO_NAME}-untrained"
    return f"{DEMO_NAME}-{fingerprint(config)['train_config'][:8]}"


def ensure_demo_model(cache_dir: Path | None = None, *, force: bool = False,
                      config: TrainConfig = TrainConfig(), progress: bool = True) -> Path:
    """Return the cached demo-model folder, training it first if missing, stale or ``force``d."""
    cache = Path(cache_dir) if cache_dir is not None else recipe.default_cache_dir()
    target = cache / cache_name(config)
    if not force and _is_current(target, config):
        return target
    cache.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = recipe.ensure_tokenizer(config.vocab_size, cache)
    with recipe._lock(cache / f".{target.name}.lock"):
        if not force and _is_current(target, config):  # built by another process meanwhile
            return target
        build_atomically(target, config, tokenizer_dir=tokenizer_dir, progress=progress)
    return target


def build_atomically(target: Path, config: TrainConfig, *, tokenizer_dir: Path | None = None,
                     progress: bool = True) -> Path:
    """Build into a temporary sibling of ``target``, then rename it into place (replacing it)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        build_demo_model(tmp, config, tokenizer_dir=tokenizer_dir, progress=progress)
        marker = {**fingerprint(config), "model": DEMO_NAME}
        (tmp / recipe.MARKER).write_text(json.dumps(marker, sort_keys=True) + "\n",
                                         encoding="utf-8")
        for path in tmp.iterdir():
            path.chmod(0o644)
        tmp.chmod(0o755)
        _replace_dir(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _replace_dir(new: Path, target: Path) -> None:
    """Move ``new`` to ``target``, atomically replacing an existing folder."""
    stale = None
    if target.exists():
        stale = Path(tempfile.mkdtemp(prefix=f".{target.name}.stale-", dir=target.parent))
        os.replace(target, stale / target.name)
    os.replace(new, target)
    if stale is not None:
        shutil.rmtree(stale, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> None:
    """CLI: train (or find) the demo model and print its folder."""
    parser = argparse.ArgumentParser(
        prog="python -m gridserve.demo.train",
        description="Train the demo model (a small Llama on Python's stdlib) and print its folder.",
    )
    parser.add_argument("--force", action="store_true", help="retrain even if a current one is cached")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help=f"cache folder (default: ${recipe.CACHE_ENV} or ~/.cache/gridserve/models)")
    parser.add_argument("--output", type=Path, default=None,
                        help="build into this folder instead of the cache (it must not exist yet)")
    parser.add_argument("--steps", type=int, default=TrainConfig.steps,
                        help="optimiser steps (0: save the untrained initialisation)")
    parser.add_argument("--seed", type=int, default=TrainConfig.seed)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        config = TrainConfig(steps=args.steps, seed=args.seed)
    except ValueError as exc:
        parser.error(str(exc))
    if args.output is not None:
        if args.output.exists():
            parser.error(f"--output {args.output} exists")
        print(build_atomically(args.output, config))
    else:
        print(ensure_demo_model(args.cache_dir, force=args.force, config=config))


if __name__ == "__main__":
    main()
