"""``gridserve eval chat``: a fixed question set asked through a server's OpenAI API, scored.

Questions
    ``chat_questions.jsonl`` beside this module: one JSON object a line, ``{"question": ...,
    "expect": [...]}``. Each question is the only user message of a chat (the model's chat
    template adds its default system prompt, if any).

Match rule
    An answer passes when **every** entry of ``expect`` occurs in it, case-insensitively, as a
    substring; an entry that is a list is one requirement met by **any** of its strings. So
    ``["paris"]`` asks for "paris", ``[["4", "four"]]`` for "4" or "four", and ``["def",
    ["** 2", "**2"]]`` for "def" and a square. Nothing else: no judge model, no normalisation.

Decoding
    Greedy (``temperature=0``), at most ``max_tokens`` new tokens (default 64), through the real
    ``openai`` client against ``--base-url`` (default: a local ``gridserve serve``), the model
    being the first of ``/v1/models`` unless named; one question at a time, or ``concurrency`` at
    once (the server batches them; greedy tokens do not depend on the batch).
    ``--compare-transformers MODEL`` answers the same questions with transformers on the same
    weights (a ``.gguf`` file or a folder; its chat template, ``generate(do_sample=False)``, the
    same token budget) and prints both scores and which answers differ.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from gridserve.shared.errors import InvalidArgumentError

logger = logging.getLogger(__name__)

QUESTIONS_FILE = Path(__file__).with_name("chat_questions.jsonl")
DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"
DEFAULT_MAX_TOKENS = 64
DEFAULT_TIMEOUT_S = 120.0
# The flag to blame for an HTTP error status of the server.
_STATUS_FIELDS = {401: "api_key", 403: "api_key", 404: "model"}


@dataclass(frozen=True)
class Question:
    """One question and what its answer must contain: every requirement, each any of its strings."""

    question: str
    expect: tuple[tuple[str, ...], ...]

    def passes(self, answer: str) -> bool:
        text = answer.lower()
        return all(any(option.lower() in text for option in options) for options in self.expect)

    def to_dict(self) -> dict[str, Any]:
        return {"question": self.question,
                "expect": [options[0] if len(options) == 1 else list(options) for options in self.expect]}


@dataclass
class ChatResult:
    """The answers of one backend (``gridserve`` or ``transformers``) to the question set."""

    backend: str
    model: str
    answers: list[str]
    passed: list[bool] = field(default_factory=list)

    @property
    def score(self) -> int:
        return sum(self.passed)

    def to_dict(self, questions: Sequence[Question]) -> dict[str, Any]:
        rows = [{**q.to_dict(), "answer": a, "passed": p} for q, a, p in zip(questions, self.answers, self.passed)]
        return {"backend": self.backend, "model": self.model, "score": self.score, "total": len(rows),
                "answers": rows}


def load_questions(path: Path = QUESTIONS_FILE) -> list[Question]:
    """The question set at ``path``; ``InvalidArgumentError`` naming the line when one is malformed."""
    questions = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            questions.append(_question(json.loads(line), f"{path.name}:{number}"))
    if not questions:
        raise InvalidArgumentError("questions", f"{path} holds no questions")
    return questions


def _question(row: Any, where: str) -> Question:
    if not isinstance(row, dict) or not isinstance(row.get("question"), str) or not row["question"].strip():
        raise InvalidArgumentError("questions", f"{where}: needs a non-empty string 'question'")
    expect = row.get("expect")
    if not isinstance(expect, list) or not expect:
        raise InvalidArgumentError("questions", f"{where}: 'expect' must be a non-empty list")
    requirements = []
    for entry in expect:
        options = [entry] if isinstance(entry, str) else entry
        if not isinstance(options, list) or not options or not all(isinstance(o, str) and o for o in options):
            raise InvalidArgumentError("questions", f"{where}: each 'expect' entry is a string or a list of strings")
        requirements.append(tuple(options))
    return Question(row["question"], tuple(requirements))


def _messages(question: Question) -> list[dict[str, str]]:
    return [{"role": "user", "content": question.question}]


def ask_server(questions: Sequence[Question], base_url: str = DEFAULT_BASE_URL, model: Optional[str] = None,
               max_tokens: int = DEFAULT_MAX_TOKENS, api_key: Optional[str] = None,
               timeout_s: float = DEFAULT_TIMEOUT_S, concurrency: int = 1) -> ChatResult:
    """Each question as a greedy chat completion from the OpenAI server at ``base_url``, up to
    ``concurrency`` in flight; answers in the order of ``questions``."""
    import openai

    if concurrency < 1:
        raise InvalidArgumentError("concurrency", f"must be at least 1, got {concurrency}")
    client = openai.OpenAI(base_url=base_url, api_key=api_key or "unused", timeout=timeout_s, max_retries=0)

    def answer(question: Question) -> str:
        response = client.chat.completions.create(model=model, messages=_messages(question),
                                                  temperature=0.0, max_tokens=max_tokens)
        logger.debug("%s -> %r", question.question, response.choices[0].message.content)
        return response.choices[0].message.content or ""

    try:
        model = model or _first_model(client, base_url)
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            answers = list(pool.map(answer, questions))
    except openai.APITimeoutError:
        raise InvalidArgumentError("timeout", f"{base_url} gave no answer within {timeout_s} s") from None
    except openai.APIConnectionError as exc:
        raise InvalidArgumentError("base_url", f"no OpenAI server answers at {base_url} ({exc}); "
                                               "start one with `gridserve serve`") from None
    except openai.APIStatusError as exc:
        field = _STATUS_FIELDS.get(exc.status_code, "base_url")
        raise InvalidArgumentError(field, f"{base_url} answered {exc.status_code}: {exc.message}") from None
    finally:
        client.close()
    return _scored(ChatResult("gridserve", model, answers), questions)


def _first_model(client: Any, base_url: str) -> str:
    models = client.models.list().data
    if not models:
        raise InvalidArgumentError("model", f"{base_url}/models lists no model")
    return models[0].id


def ask_transformers(questions: Sequence[Question], model: str | Path,
                     max_tokens: int = DEFAULT_MAX_TOKENS) -> ChatResult:
    """Each question through transformers on the same weights: its chat template, greedy ``generate``."""
    import torch

    from gridserve.evals.models import resolve_model, transformers_model, transformers_tokenizer

    path = resolve_model(model)
    tokenizer, hf_model = transformers_tokenizer(path), transformers_model(path)
    answers = []
    with torch.inference_mode():
        for question in questions:
            inputs = tokenizer.apply_chat_template(_messages(question), add_generation_prompt=True, tokenize=True,
                                                   return_dict=True, return_tensors="pt")
            output = hf_model.generate(**inputs, max_new_tokens=max_tokens, do_sample=False,
                                       pad_token_id=tokenizer.eos_token_id)
            new = output[0, inputs["input_ids"].shape[1]:]
            answers.append(tokenizer.decode(new, skip_special_tokens=True))
    return _scored(ChatResult("transformers", str(model), answers), questions)


def _scored(result: ChatResult, questions: Sequence[Question]) -> ChatResult:
    result.passed = [q.passes(a) for q, a in zip(questions, result.answers)]
    return result


def differing(a: ChatResult, b: ChatResult) -> list[int]:
    """Indices of the questions whose two answers are not the same text."""
    return [i for i, (x, y) in enumerate(zip(a.answers, b.answers)) if x != y]


# --------------------------------------------------------------------------------------------
# CLI: gridserve eval chat


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``gridserve eval chat`` flags (no heavy imports)."""
    parser.add_argument("--base-url", default=DEFAULT_BASE_URL, help="the OpenAI API of a running server")
    parser.add_argument("--model", default=None, help="model name to ask (default: the first of /v1/models)")
    parser.add_argument("--api-key", default=None, help="bearer token, if the server was started with --api-key")
    parser.add_argument("--questions", type=Path, default=None,
                        help="a JSONL question set (default: gridserve/evals/chat_questions.jsonl)")
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="new tokens per answer at most")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per request")
    parser.add_argument("--concurrency", type=int, default=1, help="questions in flight at once")
    parser.add_argument("--compare-transformers", metavar="MODEL_FILE", default=None,
                        help="also answer with transformers on these weights (.gguf file, HF folder, "
                        "SmolLM2-135M-Instruct or demo) and compare")
    parser.add_argument("--output", type=Path, default=None, help="write questions, answers and scores as JSON")


def run(args: argparse.Namespace) -> int:
    """Run ``gridserve eval chat``: print every question, answer and verdict, then the score(s)."""
    if args.max_tokens < 1:
        raise InvalidArgumentError("max_tokens", f"must be at least 1, got {args.max_tokens}")
    questions = load_questions(args.questions or QUESTIONS_FILE)
    logging.getLogger("httpx2").setLevel(logging.WARNING)  # the openai client's line per request
    results = [ask_server(questions, args.base_url, args.model, args.max_tokens, args.api_key, args.timeout,
                          args.concurrency)]
    if args.compare_transformers:
        results.append(ask_transformers(questions, args.compare_transformers, args.max_tokens))
    _print(questions, results)
    if args.output is not None:
        report: dict[str, Any] = {"base_url": args.base_url, "max_tokens": args.max_tokens,
                                  "results": [r.to_dict(questions) for r in results]}
        if len(results) == 2:
            report["differing_answers"] = differing(*results)
        args.output.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return 0


def _print(questions: Sequence[Question], results: Sequence[ChatResult]) -> None:
    for i, question in enumerate(questions):
        verdicts = " ".join("PASS" if r.passed[i] else "FAIL" for r in results)
        print(f"[{i + 1:2}] {verdicts}  {question.question}")
        for r in results if len({r.answers[i] for r in results}) > 1 else results[:1]:
            print(f"     {r.backend + ':':<13} {json.dumps(r.answers[i], ensure_ascii=False)}")
    total = len(questions)
    print("score: " + ", ".join(f"{r.backend} ({r.model}) {r.score}/{total}" for r in results))
    if len(results) == 2:
        print(f"identical answers: {total - len(differing(*results))}/{total}")
