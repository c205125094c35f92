"""``gridserve eval perplexity``: held-out perplexity, computed by gridserve's own offline engine.

Model
    Each file is one document: its tokens, after a BOS when the model begins text with one -- a
    folder's tokenizer's BOS whenever it has one (the demo model is trained on BOS + file), a
    GGUF's only when the file sets ``tokenizer.ggml.add_bos_token`` (llama.cpp's rule; SmolLM2:
    no BOS). Every token after the first is a target, scored once, with up to ``context_len``
    tokens of the same document before it: a sliding window (``context_len`` tokens, advanced by
    ``stride``) whose targets are only the tokens the previous window did not score (the usual
    strided evaluation; ``stride < context_len`` so each scored token has at least ``context_len -
    stride`` tokens of context except at the start of a file). Perplexity is ``exp(sum of NLL /
    number of targets)`` over all files (token-weighted).

Files
    Given, or by default: for the demo models their held-out stdlib files
    (:func:`gridserve.demo.corpus.heldout_files`); for any other model this repository's own
    English prose, ``README.md`` and ``docs/getting-started.md`` (present in a source checkout).

Backends
    ``gridserve``: every window is a prompt to :class:`gridserve.LLM` with
    ``SamplingParams(max_tokens=1, prompt_logprobs=0)``; the worker's model runner returns the
    logprob of every prompt token given its prefix (log-softmax of the float32 logits), so the
    whole engine -- scheduler, paged KV cache, attention kernels, and whatever ``quantization`` /
    ``kv_cache_dtype`` the ``LLM`` keyword arguments select -- is what is measured.
    ``transformers``: the same windows of the same token ids through ``AutoModelForCausalLM``
    (float32; a GGUF through transformers' own GGUF loading), the reference.

Python::

    from gridserve.evals.perplexity import perplexity
    ppl = perplexity(None)                            # SmolLM2 on README.md + docs/getting-started.md
    ppl_q = perplexity("demo", quantization="int8")   # any LLM keyword argument
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from gridserve.default_model import DEFAULT_MODEL_NAME
from gridserve.evals.models import DEMO_ALIASES, resolve_model, transformers_model
from gridserve.shared.errors import InvalidArgumentError
from gridserve.shared.gguf_config import is_gguf

logger = logging.getLogger(__name__)

DEFAULT_CONTEXT_LEN = 256
BACKENDS = ("gridserve", "transformers")
REPO = Path(__file__).resolve().parents[2]
#: The held-out English text of every model but the demo ones: this repository's own prose.
PROSE_FILES = ("README.md", "docs/getting-started.md")


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


def default_files(model: Optional[str | Path]) -> list[Path]:
    """The files scored when none are given (see the module docstring)."""
    if str(model) in DEMO_ALIASES:
        from gridserve.demo.corpus import heldout_files

        return heldout_files()
    paths = [REPO / name for name in PROSE_FILES]
    if not all(p.is_file() for p in paths):
        raise InvalidArgumentError("files", f"none given, and the default ({', '.join(PROSE_FILES)} of a "
                                            "gridserve source checkout) is not here: name text files to score")
    return paths


def _tokenizer(model_path: Path) -> tuple[Any, Optional[int]]:
    """A ``tokenizers.Tokenizer`` of the model and the BOS id each document starts with (or None)."""
    if is_gguf(model_path):
        from gridserve.shared.gguf_tokenizer import tokenizer_from_gguf

        converted = tokenizer_from_gguf(str(model_path))
        bos = converted.config.get("bos_token") if converted.config.get("add_bos_token") else None
        return converted.tokenizer, None if bos is None else converted.tokenizer.token_to_id(bos)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    return tokenizer.backend_tokenizer, tokenizer.bos_token_id


def load_documents(model_path: Path, files: Sequence[Path]) -> list[list[int]]:
    """Tokenize ``files`` with the model's tokenizer, one document each (empty files skipped)."""
    tokenizer, bos_id = _tokenizer(model_path)
    texts = [text for text in (Path(p).read_text(encoding="utf-8", errors="ignore") for p in files) if text]
    prefix = [] if bos_id is None else [bos_id]
    return [[*prefix, *enc.ids] for enc in tokenizer.encode_batch(texts, add_special_tokens=False)]


def _plan(docs: list[list[int]], context_len: int, stride: int) -> list[Window]:
    plan = [w for i, doc in enumerate(docs) for w in windows(i, len(doc), context_len, stride)]
    if not plan:
        raise InvalidArgumentError("files", "no file has two tokens or more to score")
    return plan


def gridserve_nll(model_path: Path, docs: list[list[int]], context_len: int, stride: int,
                  **llm_kwargs: Any) -> PerplexityResult:
    """Score ``docs`` with gridserve's offline ``LLM`` (prompt logprobs); see the module docstring.

    ``max_model_len`` defaults to ``context_len + 1`` (a window and the one token generated), which
    keeps the KV cache of a long-context model small."""
    from gridserve import LLM, SamplingParams

    plan = _plan(docs, context_len, stride)
    llm = LLM(str(model_path), **{"max_model_len": context_len + 1, **llm_kwargs})
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

    model = transformers_model(model_path)
    nll, count = 0.0, 0
    with torch.inference_mode():
        for w in _plan(docs, context_len, stride):
            ids = torch.tensor(docs[w.doc][w.start:w.end], dtype=torch.int64)
            logprobs = torch.log_softmax(model(input_ids=ids[None]).logits[0].float(), dim=-1)
            rows = torch.arange(w.first - w.start, w.end - w.start)
            nll -= logprobs[rows - 1, ids[rows]].double().sum().item()
            count += len(rows)
    return PerplexityResult("transformers", nll, count, len(docs), context_len, stride)


def evaluate(model: Optional[str | Path] = None, files: Sequence[str | Path] | None = None, *,
             backend: str = "gridserve", context_len: int = DEFAULT_CONTEXT_LEN,
             stride: int | None = None, max_files: int | None = None,
             **llm_kwargs: Any) -> PerplexityResult:
    """Perplexity of ``model`` (default: SmolLM2) on ``files`` (default: see the module docstring).

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
    paths = [Path(f) for f in files] if files else default_files(model)
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise InvalidArgumentError("files", f"not a file: {', '.join(missing[:5])}")
    paths = paths[:max_files] if max_files is not None else paths
    docs = load_documents(model_path, paths)
    if backend == "transformers":
        return transformers_nll(model_path, docs, context_len, stride)
    return gridserve_nll(model_path, docs, context_len, stride, **llm_kwargs)


def perplexity(model: Optional[str | Path] = None, files: Sequence[str | Path] | None = None,
               **kwargs: Any) -> float:
    """:func:`evaluate`'s perplexity alone: ``perplexity("demo", quantization="int8")``."""
    return evaluate(model, files, **kwargs).perplexity


# --------------------------------------------------------------------------------------------
# CLI: gridserve eval perplexity


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``gridserve eval perplexity`` flags (no heavy imports)."""
    parser.add_argument("model", nargs="?", default=None,
                        help=f".gguf file, HF model folder, {DEFAULT_MODEL_NAME} (the default model, the default) "
                        "or 'demo' / 'demo-untrained' (built if missing)")
    parser.add_argument("files", nargs="*", type=Path,
                        help="text files to score (default: the demo models' held-out stdlib files; for other "
                        f"models {' and '.join(PROSE_FILES)} of this source checkout)")
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
        print(f"relative difference gridserve vs transformers: {relative_difference(*results):.2e}")
    if args.output_json is not None:
        files = [Path(f) for f in args.files] or default_files(args.model)
        report = {"model": str(args.model or DEFAULT_MODEL_NAME),
                  "files": [_shown(f) for f in files[:args.max_files]],
                  "llm_kwargs": llm_kwargs, "results": [r.to_dict() for r in results]}
        if len(results) == 2:
            report["relative_difference"] = relative_difference(*results)
        args.output_json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


def _shown(path: Path) -> str:
    """``path`` relative to the repository when it is inside it (results files stay portable)."""
    resolved = path.resolve()
    return str(resolved.relative_to(REPO)) if resolved.is_relative_to(REPO) else str(path)


def relative_difference(ours: PerplexityResult, reference: PerplexityResult) -> float:
    """``|ours / reference - 1|`` of the two perplexities."""
    return abs(ours.perplexity / reference.perplexity - 1.0)
