"""``gridserve eval perplexity``: held-out perplexity, computed by gridserve's own offline engine.

Model
    Each file is one document: BOS (when the tokenizer has one) then its tokens, as the demo model
    was trained (:func:`gridserve.demo.corpus.encode_documents`). Every token after the first is a
    target, scored once, with up to ``context_len`` tokens of the same document before it: a
    sliding window (``context_len`` tokens, advanced by ``stride``) whose targets are only the
    tokens the previous window did not score (the usual strided evaluation; ``stride <
    context_len`` so each scored token has at least ``context_len - stride`` tokens of context
    except at the start of a file). Perplexity is ``exp(sum of NLL / number of targets)`` over
    all files (token-weighted).

Backends
    ``gridserve``: every window is a prompt to :class:`gridserve.LLM` with
    ``SamplingParams(max_tokens=1, prompt_logprobs=0)``; the worker's model runner returns the
    logprob of every prompt token given its prefix (log-softmax of the float32 logits), so the
    whole engine -- scheduler, paged KV cache, attention kernels, and whatever ``quantization`` /
    ``kv_cache_dtype`` the ``LLM`` keyword arguments select -- is what is measured.
    ``transformers``: the same windows through ``AutoModelForCausalLM`` (float32), the reference.

Python::

    from gridserve.demo.perplexity import perplexity
    ppl = perplexity(model_path)                     # the demo model's held-out files
    ppl_q = perplexity(model_path, quantization="int8")  # any LLM keyword argument
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from gridserve.shared.errors import InvalidArgumentError

logger = logging.getLogger(__name__)

DEFAULT_CONTEXT_LEN = 256
BACKENDS = ("gridserve", "transformers")
#: Model aliases: the cached demo model and its untrained initialisation.
MODEL_ALIASES = ("demo", "demo-untrained")


@dataclass(frozen=True)
class Window:
    """A prompt ``tokens[start:end]`` of one document; targets are positions ``first..end-1``."""

    doc: int
    start: int
    end: int
    first: int


@dataclass
class PerplexityResult:
    """Summed negative log-likelihood over the scored tokens, and what was scored."""

    backend: str
    nll_sum: float
    num_tokens: int
    num_files: int
    context_len: int
    stride: int

    @property
    def mean_nll(self) -> float:
        return self.nll_sum / self.num_tokens

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean_nll)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "mean_nll": self.mean_nll, "perplexity": self.perplexity}


def windows(doc: int, num_tokens: int, context_len: int, stride: int) -> list[Window]:
    """The windows that score every target ``1..num_tokens-1`` of a document exactly once."""
    if num_tokens < 2:
        return []
    result = []
    first, end = 1, min(context_len, num_tokens)
    while True:
        result.append(Window(doc, max(0, end - context_len), end, first))
        if end >= num_tokens:
            return result
        first, end = end, min(end + stride, num_tokens)


def check_window(context_len: int, stride: int | None) -> int:
    """Validate ``context_len`` / ``stride``; return the stride (default: half the context)."""
    if context_len < 2:
        raise InvalidArgumentError("context_len", f"must be at least 2, got {context_len}")
    stride = context_len // 2 if stride is None else stride
    if not 1 <= stride < context_len:
        raise InvalidArgumentError("stride", f"must be in [1, context_len={context_len}), got {stride}")
    return stride


def resolve_model(model: str | Path) -> Path:
    """A model folder; ``demo`` / ``demo-untrained`` build (or find) the cached demo model."""
    if str(model) in MODEL_ALIASES:
        from gridserve.demo.train import TrainConfig, ensure_demo_model

        config = TrainConfig() if str(model) == "demo" else TrainConfig(steps=0)
        return ensure_demo_model(config=config)
    path = Path(model)
    if not (path / "config.json").is_file():
        raise InvalidArgumentError("model", f"{model} is not a model folder (no config.json there)")
    return path


def default_files() -> list[Path]:
    """The demo model's held-out files (see :mod:`gridserve.demo.corpus`)."""
    from gridserve.demo.corpus import heldout_files

    return heldout_files()


def load_documents(model_path: Path, files: Sequence[Path]) -> list[list[int]]:
    """Tokenize ``files`` with the model's tokenizer, one document each (BOS first if it has one)."""
    from transformers import AutoTokenizer

    from gridserve.demo.corpus import encode_documents

    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    return encode_documents(tokenizer, files, tokenizer.bos_token_id)


def _plan(docs: list[list[int]], context_len: int, stride: int) -> list[Window]:
    plan = [w for i, doc in enumerate(docs) for w in windows(i, len(doc), context_len, stride)]
    if not plan:
        raise InvalidArgumentError("files", "no file has two tokens or more to score")
    return plan


def gridserve_nll(model_path: Path, docs: list[list[int]], context_len: int, stride: int,
                  **llm_kwargs: Any) -> PerplexityResult:
    """Score ``docs`` with gridserve's offline ``LLM`` (prompt logprobs); see the module docstring."""
    from gridserve import LLM, SamplingParams

    plan = _plan(docs, context_len, stride)
    llm = LLM(str(model_path), **llm_kwargs)
    try:
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        prompts = [{"prompt_token_ids": docs[w.doc][w.start:w.end]} for w in plan]
        outputs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.shutdown()
    nll, count = 0.0, 0
    for w, out in zip(plan, outputs):
        ids = docs[w.doc]
        for pos in range(w.first, w.end):
            nll -= out.prompt_logprobs[pos - w.start][ids[pos]].logprob
            count += 1
    return PerplexityResult("gridserve", nll, count, len(docs), context_len, stride)


def transformers_nll(model_path: Path, docs: list[list[int]], context_len: int,
                     stride: int) -> PerplexityResult:
    """Score ``docs`` with transformers' ``AutoModelForCausalLM`` in float32 (the reference)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32).eval()
    nll, count = 0.0, 0
    with torch.inference_mode():
        for w in _plan(docs, context_len, stride):
            ids = torch.tensor(docs[w.doc][w.start:w.end], dtype=torch.int64)
            logprobs = torch.log_softmax(model(input_ids=ids[None]).logits[0].float(), dim=-1)
            rows = torch.arange(w.first - w.start, w.end - w.start)
            nll -= logprobs[rows - 1, ids[rows]].double().sum().item()
            count += len(rows)
    return PerplexityResult("transformers", nll, count, len(docs), context_len, stride)


def evaluate(model: str | Path, files: Sequence[str | Path] | None = None, *,
             backend: str = "gridserve", context_len: int = DEFAULT_CONTEXT_LEN,
             stride: int | None = None, max_files: int | None = None,
             **llm_kwargs: Any) -> PerplexityResult:
    """Perplexity of ``model`` on ``files`` (default: the demo model's held-out files).

    ``llm_kwargs`` go to :class:`gridserve.LLM` (``quantization``, ``kv_cache_dtype``, ``dtype``,
    ...) and are an error with the ``transformers`` backend.
    """
    if backend not in BACKENDS:
        raise InvalidArgumentError("backend", f"must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if backend == "transformers" and llm_kwargs:
        raise InvalidArgumentError("backend", f"transformers takes no LLM arguments, got {sorted(llm_kwargs)}")
    stride = check_window(context_len, stride)
    if max_files is not None and max_files < 1:
        raise InvalidArgumentError("max_files", f"must be at least 1, got {max_files}")
    model_path = resolve_model(model)
    paths = [Path(f) for f in files] if files else default_files()
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise InvalidArgumentError("files", f"not a file: {', '.join(missing[:5])}")
    paths = paths[:max_files] if max_files is not None else paths
    docs = load_documents(model_path, paths)
    if backend == "transformers":
        return transformers_nll(model_path, docs, context_len, stride)
    return gridserve_nll(model_path, docs, context_len, stride, **llm_kwargs)


def perplexity(model: str | Path, files: Sequence[str | Path] | None = None,
               **kwargs: Any) -> float:
    """:func:`evaluate`'s perplexity alone: ``perplexity(path, quantization="int8")``."""
    return evaluate(model, files, **kwargs).perplexity


# --------------------------------------------------------------------------------------------
# CLI: gridserve eval perplexity


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``gridserve eval perplexity`` flags (no heavy imports)."""
    parser.add_argument("model", help="HF model folder, or 'demo' / 'demo-untrained' (built if missing)")
    parser.add_argument("files", nargs="*", type=Path,
                        help="text files to score (default: the demo model's held-out stdlib files)")
    parser.add_argument("--max-files", type=int, default=None, help="score only the first N files")
    parser.add_argument("--context-len", type=int, default=DEFAULT_CONTEXT_LEN,
                        help="tokens per window (at most the model's max_model_len - 1)")
    parser.add_argument("--stride", type=int, default=None,
                        help="tokens a window advances by (default: context_len / 2)")
    parser.add_argument("--quantization", default=None, help="LLM(quantization=...) for the gridserve backend")
    parser.add_argument("--kv-cache-dtype", default=None, help="LLM(kv_cache_dtype=...)")
    parser.add_argument("--dtype", default=None, help="LLM(dtype=...)")
    parser.add_argument("--compare-transformers", action="store_true",
                        help="also compute it with transformers on the same tokens and report both")
    parser.add_argument("--output-json", type=Path, default=None, help="write the results as JSON here")


def run(args: argparse.Namespace) -> int:
    """Run ``gridserve eval perplexity``; prints one line per backend."""
    llm_kwargs = {name: getattr(args, name) for name in ("quantization", "kv_cache_dtype", "dtype")
                  if getattr(args, name) is not None}
    common = {"context_len": args.context_len, "stride": args.stride, "max_files": args.max_files}
    results = [evaluate(args.model, args.files, **common, **llm_kwargs)]
    if args.compare_transformers:
        results.append(evaluate(args.model, args.files, backend="transformers", **common))
    for r in results:
        print(f"{r.backend:>12}: perplexity {r.perplexity:.4f} (mean NLL {r.mean_nll:.4f} nats over "
              f"{r.num_tokens} tokens, {r.num_files} files, context {r.context_len}, stride {r.stride})")
    if len(results) == 2:
        rel = abs(results[0].perplexity / results[1].perplexity - 1.0)
        print(f"relative difference gridserve vs transformers: {rel:.2e}")
    if args.output_json is not None:
        report = {"model": str(args.model), "llm_kwargs": llm_kwargs,
                  "results": [r.to_dict() for r in results]}
        args.output_json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0
