"""``RequestLimits``: the caps a gateway puts on every request, from ``gridserve gateway`` flags.

The protocol models (``protocol.py``) name the cap that bounds each field; the values come from
here, handed to validation as context, so one set of numbers guards the REST routes and the
typed gRPC API alike. Each default is generous for real use and small enough that one request
cannot stall the gateway (``n`` is copied into ``n`` engine requests; every prompt is tokenized;
every stop string is searched on every step).

Two caps bound what one request puts into the engines rather than one of its fields:
``max_sequences_per_request`` (``n`` x its prompts: every one is an engine request, a slot in a
waiting queue and KV blocks) and ``max_prompt_tokens_per_request`` (the prompt tokens it has in the
engines at once, a ``RequestBudget``). A completions request with several prompts opens its budget
in the route (``open_request``); the gateway service takes each prompt's tokens from it once
tokenized and gives them back when that prompt ends. A request's first prompt always fits (the
model's ``max_model_len`` bounds it alone), and streamed prompts run one after another.
"""

from __future__ import annotations

import argparse
from contextvars import ContextVar
from dataclasses import dataclass, fields
from typing import Optional

from gridserve.services.gateway.chat_options import ChatOptions, add_chat_arguments
from gridserve.services.gateway.media_loader import MediaConfig, add_media_arguments
from gridserve.services.gateway.responses_store import (
    ResponsesStoreOptions,
    add_responses_arguments,
)
from gridserve.shared.envs import add_option
from gridserve.shared.errors import InvalidArgumentError

BLOCKING_THREADS = 8


@dataclass(frozen=True)
class RequestLimits:
    """Per-request caps (a flag ``--<name-with-dashes>`` each)."""

    max_n: int = 128
    max_best_of: int = 128
    max_prompts_per_request: int = 256
    max_sequences_per_request: int = 256  # >= max_n and max_best_of: a beam of that width fits too
    max_prompt_tokens_per_request: int = 262144
    max_stop_strings: int = 64
    max_stop_string_chars: int = 512
    max_stop_token_ids: int = 1024
    max_logit_bias: int = 1024
    max_logprobs: int = 20
    max_structured_output_chars: int = 65536
    max_messages: int = 1024
    max_content_chars: int = 1_000_000
    max_chat_template_chars: int = 65536
    max_rendered_template_chars: int = 4_000_000
    template_render_timeout_s: float = 2.0
    request_timeout: float = 3600.0
    trust_request_chat_template: bool = False
    # A request's nonzero ``priority`` is accepted (for engines with --scheduling-policy priority).
    allow_client_priority: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RequestLimits:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})

    def to_argv(self) -> list[str]:
        """These limits as ``gridserve gateway`` flags (only the ones that differ from the default)."""
        argv: list[str] = []
        for f in fields(self):
            value = getattr(self, f.name)
            if value == f.default:
                continue
            flag = "--" + f.name.replace("_", "-")
            argv += [flag] if value is True else [flag, str(value)]
        return argv

    def check_sequences(self, num_prompts: int, n: int) -> None:
        """More sequences than ``max_sequences_per_request`` are an ``InvalidArgumentError`` naming ``n``."""
        sequences = num_prompts * n
        if sequences > self.max_sequences_per_request:
            prompts = f" x {num_prompts} prompts = {sequences} sequences" if num_prompts > 1 else " sequences"
            raise InvalidArgumentError("n", f"{n}{prompts}; at most {self.max_sequences_per_request} per request "
                                            "(--max-sequences-per-request)")

    def open_request(self, num_prompts: int, n: int) -> RequestBudget:
        """Check a request of ``num_prompts`` prompts with ``n`` samples each and make its budget the
        current one: the prompts this task (and the tasks it starts) hands to
        ``GatewayService.generate`` share it."""
        self.check_sequences(num_prompts, n)
        budget = RequestBudget(self.max_prompt_tokens_per_request)
        _CURRENT.set(budget)
        return budget


class RequestBudget:
    """The prompt tokens one request has in the engines now, against its cap. Used on the
    gateway's event loop only."""

    def __init__(self, max_prompt_tokens: int) -> None:
        self.max_prompt_tokens = max_prompt_tokens
        self.in_flight = 0

    def take(self, tokens: int) -> None:
        """Count a prompt of ``tokens`` in; beyond the cap (unless it is the only one in flight) an
        ``InvalidArgumentError`` naming ``prompt``."""
        if self.in_flight and self.in_flight + tokens > self.max_prompt_tokens:
            raise InvalidArgumentError("prompt", f"{self.in_flight + tokens} prompt tokens in one request; at most "
                                                 f"{self.max_prompt_tokens} (--max-prompt-tokens-per-request)")
        self.in_flight += tokens

    def give_back(self, tokens: int) -> None:
        self.in_flight -= tokens


_CURRENT: ContextVar[Optional[RequestBudget]] = ContextVar("gridserve_request_budget", default=None)


def current_budget() -> Optional[RequestBudget]:
    """The budget ``open_request`` made for the request this task serves, if any."""
    return _CURRENT.get()


_HELP = {
    "max_n": "most samples (n) per request",
    "max_best_of": "most best_of per request",
    "max_prompts_per_request": "most prompts in one completions request, inputs in one embeddings or "
                               "classify request, text pairs in one score or rerank request",
    "max_sequences_per_request": "most sequences (n x prompts) one request puts into the engines",
    "max_prompt_tokens_per_request": "most prompt tokens one request has in the engines at once (its first "
                                     "prompt always fits: max_model_len bounds it)",
    "max_stop_strings": "most stop strings (and bad words) per request",
    "max_stop_string_chars": "longest stop string, in characters",
    "max_stop_token_ids": "most stop_token_ids / allowed_token_ids per request",
    "max_logit_bias": "most logit_bias entries per request",
    "max_logprobs": "most logprobs / top_logprobs / prompt_logprobs (never above the engine's)",
    "max_structured_output_chars": "largest JSON schema / regex / grammar / choice list, in characters",
    "max_messages": "most chat messages per request",
    "max_content_chars": "longest prompt string or chat message content, in characters",
    "max_chat_template_chars": "longest chat_template a request may carry (with the trust flag)",
    "max_rendered_template_chars": "longest rendered chat template (the model's own included)",
    "template_render_timeout_s": "seconds one chat template rendering may take",
    "request_timeout": "seconds one request may take end to end, then it is aborted (HTTP 504 / "
                       "DEADLINE_EXCEEDED; a gRPC caller's earlier deadline wins; 0: none)",
}


def add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``RequestLimits`` flags (``gridserve gateway`` and ``gridserve serve``)."""
    group = parser.add_argument_group("request limits (HTTP 400 / INVALID_ARGUMENT beyond them)")
    for f in fields(RequestLimits):
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            continue
        kind = float if f.type == "float" else int
        group.add_argument(flag, type=kind, default=f.default, help=f"{_HELP[f.name]} (default {f.default})")
    group.add_argument("--trust-request-chat-template", action="store_true",
                       help="let requests carry their own chat_template (refused with 400 otherwise)")
    add_option(group, "--allow-client-priority", action="store_true",
               help="let requests set a nonzero priority (lower runs first on engines with --scheduling-policy "
                    "priority; refused with 400 naming it otherwise)")
    group.add_argument("--blocking-threads", type=int, default=BLOCKING_THREADS,
                       help="gateway threads that tokenize and render chat templates off its event loop "
                            f"(default {BLOCKING_THREADS})")
    add_media_arguments(parser)
    add_chat_arguments(parser)
    add_responses_arguments(parser)


def gateway_argv(args: argparse.Namespace) -> list[str]:
    """The flags of ``add_limit_arguments`` in ``args`` as a ``gridserve gateway`` command line
    (``gridserve serve`` hands them to its gateways)."""
    argv = RequestLimits.from_args(args).to_argv() + MediaConfig.from_args(args).to_argv()
    argv += ChatOptions.from_args(args).to_argv() + ResponsesStoreOptions.from_args(args).to_argv()
    if args.blocking_threads != BLOCKING_THREADS:
        argv += ["--blocking-threads", str(args.blocking_threads)]
    return argv
