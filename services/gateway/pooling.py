"""Pooling models at the gateway: what the served model is (``ModelInfo``: its runner, the tasks it
serves, its embedding size, its ``config.json``) and how pooling inputs become engine requests.

An engine's ``GetInfo`` says ``runner`` ("generate" or "pooling"), ``supported_tasks`` (``embed``,
``classify``, ``score``) and ``hidden_size``; the gateway reads the model folder's ``config.json``
itself (as it does for vision models) for what ``PoolingParams.verify`` needs (Matryoshka support)
and a classifier's labels (``id2label``). A generate request to a pooling model, or a pooling request
to a generative model (or for a task the model does not serve), is refused with a 400 that names
the runner and the endpoints that serve the model (``check_generates`` / ``check_task``).

Tokenization (the gateway's ``tokenizers`` backend, in its blocking pool): an input longer than
``max_model_len`` is refused naming its field unless ``truncate_prompt_tokens`` is given; then a
text keeps its last tokens with the tokenizer's special tokens around them (vLLM's left truncation),
token ids their last n. A pair (a cross-encoder's query and document) is encoded as the tokenizer's
pair template (BERT: ``[CLS] a [SEP] b [SEP]`` with token type ids 0 / 1) and truncated as
sentence-transformers' ``CrossEncoder`` does (longest first, from the right).
"""

from __future__ import annotations

import base64
import json
import logging
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from gridserve.shared.errors import InvalidArgumentError
from gridserve.shared.pooling import CLASSIFY, EMBED, SCORE, PoolingParams

logger = logging.getLogger(__name__)

GENERATE, POOLING = "generate", "pooling"
# The endpoints that serve each task (for the refusals' words).
ENDPOINTS = {EMBED: ("/v1/embeddings", "/score", "/rerank"), SCORE: ("/score", "/rerank"),
             CLASSIFY: ("/classify",), GENERATE: ("/v1/completions", "/v1/chat/completions", "/v1/responses")}
API_NAMES = {EMBED: "Embeddings API", SCORE: "Score API", CLASSIFY: "Classification API"}


@dataclass(frozen=True)
class ModelInfo:
    """What serves the model and what it can do (a generative model unless the engine says otherwise)."""

    runner: str = GENERATE
    supported_tasks: tuple[str, ...] = (GENERATE,)
    hidden_size: int = 0
    hf_config: dict = field(default_factory=dict)

    @classmethod
    def from_engine_info(cls, info: Any) -> ModelInfo:
        """From an engine's ``GetInfoResponse`` (an engine that does not say: generative) and the
        model folder's ``config.json`` (``info.model_path``; none: ``{}``)."""
        runner = getattr(info, "runner", "") or GENERATE
        tasks = tuple(getattr(info, "supported_tasks", ()) or ()) or ((GENERATE,) if runner == GENERATE else ())
        return cls(runner, tasks, int(getattr(info, "hidden_size", 0) or 0),
                   read_hf_config(getattr(info, "model_path", "") or ""))

    @property
    def pooling(self) -> bool:
        return self.runner == POOLING

    def endpoints(self) -> list[str]:
        tasks = self.supported_tasks if self.pooling else (GENERATE,)
        return list(dict.fromkeys(e for task in tasks for e in ENDPOINTS.get(task, ())))

    def check_generates(self, model: str) -> None:
        """A generate request to a pooling model: 400 naming ``model``, the runner and the endpoints."""
        if self.pooling:
            raise InvalidArgumentError(
                "model", f"the model {model!r} is served by the pooling runner (tasks: "
                         f"{', '.join(self.supported_tasks)}); it does not generate text: use "
                         f"{', '.join(self.endpoints())}")

    def check_task(self, model: str, task: str) -> None:
        """A pooling request for ``task``: 400 naming ``model`` when the model generates (vLLM's "The
        model does not support Embeddings API") or serves other tasks."""
        if not self.pooling:
            raise InvalidArgumentError(
                "model", f"the model {model!r} generates text (runner generate): it does not support the "
                         f"{API_NAMES[task]}; serve a pooling model (gridserve serve MODEL --runner pooling) "
                         f"or use {', '.join(ENDPOINTS[GENERATE])}")
        if task not in self.supported_tasks:
            raise InvalidArgumentError(
                "model", f"the model {model!r} does not support the {API_NAMES[task]} (the pooling runner serves "
                         f"its tasks {', '.join(self.supported_tasks)}): use {', '.join(self.endpoints())}")

    def labels(self) -> dict[int, str]:
        """A classifier's class names by index (``config.json``'s ``id2label``)."""
        return {int(k): str(v) for k, v in (self.hf_config.get("id2label") or {}).items()}

    def verify(self, params: PoolingParams, names: dict[str, str]) -> None:
        """``PoolingParams.verify`` against the model, its refusal naming the request's field
        (``names``: ``PoolingParams`` field -> the request's)."""
        try:
            params.verify(self.supported_tasks, self.hidden_size, self.hf_config)
        except InvalidArgumentError as exc:
            name = exc.field.removeprefix("pooling_params.")
            raise InvalidArgumentError(names.get(name, name), exc.message) from None


def read_hf_config(model_path: str) -> dict:
    """The model folder's ``config.json`` (``{}`` without one, or for a single-file checkpoint)."""
    path = Path(model_path) / "config.json" if model_path else None
    if path is None or not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        logger.warning("cannot read %s: %s", path, exc)
        return {}
    return config if isinstance(config, dict) else {}


# ---- inputs ------------------------------------------------------------------------------------
@dataclass
class PoolingInput:
    """One engine request's prompt: its token ids and segment ids (None: all 0)."""

    token_ids: list[int]
    token_type_ids: Optional[list[int]] = None


def _type_ids(type_ids: list[int]) -> Optional[list[int]]:
    return list(type_ids) if any(type_ids) else None


def _keep(max_model_len: int, truncate: Optional[int]) -> Optional[int]:
    """How many tokens an input may keep (None: no truncation asked)."""
    if truncate is None:
        return None
    return max_model_len if truncate < 0 else min(truncate, max_model_len)


def encode_text(tokenizer: Any, text: str, add_special_tokens: bool, keep: Optional[int]) -> PoolingInput:
    """One text; ``keep``: its last ``keep`` tokens, the special tokens included (vLLM's left truncation)."""
    backend = tokenizer.backend_tokenizer
    encoding = backend.encode(text, add_special_tokens=False)
    if keep is not None:
        room = max(keep - (backend.num_special_tokens_to_add(False) if add_special_tokens else 0), 0)
        if len(encoding.ids) > room:
            encoding.truncate(room, direction="left")
    if add_special_tokens:
        encoding = backend.post_process(encoding, None, True)
    return PoolingInput(list(encoding.ids), _type_ids(encoding.type_ids))


def encode_pair(tokenizer: Any, first: str, second: str, keep: Optional[int]) -> PoolingInput:
    """A text pair as the tokenizer's pair template makes it (``tokenizer(first, second)``: BERT's type
    ids 0 / 1); ``keep``: at most that many tokens, the longer text losing its tail first."""
    backend = tokenizer.backend_tokenizer
    a = backend.encode(first, add_special_tokens=False)
    b = backend.encode(second, add_special_tokens=False)
    if keep is not None:
        room = max(keep - backend.num_special_tokens_to_add(True), 0)
        na, nb = len(a.ids), len(b.ids)
        while na + nb > room:
            if na > nb:
                na -= 1
            else:
                nb -= 1
        if na < len(a.ids):
            a.truncate(na)
        if nb < len(b.ids):
            b.truncate(nb)
    encoding = backend.post_process(a, b, True)
    return PoolingInput(list(encoding.ids), _type_ids(encoding.type_ids))


def tokenize_inputs(tokenizer: Any, inputs: list[Union[str, list[int]]], add_special_tokens: bool,
                    max_model_len: int, vocab_size: int, truncate: Optional[int], field_name: str,
                    ) -> list[PoolingInput]:
    """Each input (a text or token ids) as an engine prompt, within ``max_model_len`` (module docstring)."""
    keep = _keep(max_model_len, truncate)
    out = []
    for i, item in enumerate(inputs):
        where = field_name if len(inputs) == 1 else f"{field_name}[{i}]"
        if isinstance(item, str):
            prompt = encode_text(tokenizer, item, add_special_tokens, keep)
        else:
            bad = [t for t in item if not 0 <= t < vocab_size]
            if bad:
                raise InvalidArgumentError(field_name, f"{where}: token id {bad[0]} is out of range [0, {vocab_size})")
            prompt = PoolingInput(list(item[-keep:]) if keep is not None else list(item))
        check_length(prompt, max_model_len, field_name, where)
        out.append(prompt)
    return out


def tokenize_pairs(tokenizer: Any, pairs: list[tuple[str, str]], max_model_len: int, truncate: Optional[int],
                   field_name: str) -> list[PoolingInput]:
    keep = _keep(max_model_len, truncate)
    out = []
    for i, (first, second) in enumerate(pairs):
        prompt = encode_pair(tokenizer, first, second, keep)
        check_length(prompt, max_model_len, field_name, "the pair" if len(pairs) == 1 else f"pair {i}")
        out.append(prompt)
    return out


def check_length(prompt: PoolingInput, max_model_len: int, field_name: str, where: str) -> None:
    """Refused naming ``field_name`` (``where``: which of its items) beyond ``max_model_len``."""
    if not prompt.token_ids:
        raise InvalidArgumentError(field_name, f"{where} tokenizes to no tokens")
    if len(prompt.token_ids) > max_model_len:
        raise InvalidArgumentError(field_name, f"{where} is {len(prompt.token_ids)} tokens, more than the model's "
                                               f"maximum context length {max_model_len}: shorten it or set "
                                               "truncate_prompt_tokens")


def check_total_tokens(prompts: list[PoolingInput], cap: int, field_name: str) -> int:
    """All inputs run at once: their tokens together within ``--max-prompt-tokens-per-request`` (one
    input always fits: ``max_model_len`` bounds it)."""
    total = sum(len(p.token_ids) for p in prompts)
    if len(prompts) > 1 and total > cap:
        raise InvalidArgumentError(field_name, f"{total} tokens in {len(prompts)} inputs; at most {cap} per request "
                                               "(--max-prompt-tokens-per-request)")
    return total


# ---- outputs -----------------------------------------------------------------------------------
def to_base64(values: list[float]) -> str:
    """Little-endian float32 bytes, base64 (what OpenAI's client decodes with numpy)."""
    data = struct.pack(f"<{len(values)}f", *values)
    return base64.b64encode(data).decode("ascii")


def cosine(a: list[float], b: list[float]) -> float:
    """Cosine similarity (0 when either vector is zero)."""
    dot = math.fsum(x * y for x, y in zip(a, b))
    norm = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    return dot / norm if norm else 0.0


def pair_up(first: Union[str, list[str]], second: Union[str, list[str]]) -> list[tuple[str, str]]:
    """vLLM's score pairing: one ``text_1`` with every ``text_2`` (1:N), else one to one (N:N)."""
    a = [first] if isinstance(first, str) else list(first)
    b = [second] if isinstance(second, str) else list(second)
    if len(a) == 1:
        return [(a[0], t) for t in b]
    if len(a) != len(b):
        raise InvalidArgumentError("text_2", f"{len(b)} texts for {len(a)} text_1 texts: give one text_1, or as "
                                             "many text_1 as text_2")
    return list(zip(a, b))

