"""``RequestLimits``: the caps a gateway puts on every request, from ``gridserve gateway`` flags.

The protocol models (``protocol.py``) name the cap that bounds each field; the values come from
here, handed to validation as context, so one set of numbers guards the REST routes and the
typed gRPC API alike. Each default is generous for real use and small enough that one request
cannot stall the gateway (``n`` is copied into ``n`` engine requests; every prompt is tokenized;
every stop string is searched on every step).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from gridserve.services.gateway.chat_options import ChatOptions, add_chat_arguments
from gridserve.services.gateway.media_loader import MediaConfig, add_media_arguments

BLOCKING_THREADS = 8


@dataclass(frozen=True)
class RequestLimits:
    """Per-request caps (a flag ``--<name-with-dashes>`` each)."""

    max_n: int = 128
    max_best_of: int = 128
    max_prompts_per_request: int = 256
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


_HELP = {
    "max_n": "most samples (n) per request",
    "max_best_of": "most best_of per request",
    "max_prompts_per_request": "most prompts in one completions request",
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
    group.add_argument("--blocking-threads", type=int, default=BLOCKING_THREADS,
                       help="gateway threads that tokenize and render chat templates off its event loop "
                            f"(default {BLOCKING_THREADS})")
    add_media_arguments(parser)
    add_chat_arguments(parser)


def gateway_argv(args: argparse.Namespace) -> list[str]:
    """The flags of ``add_limit_arguments`` in ``args`` as a ``gridserve gateway`` command line
    (``gridserve serve`` hands them to its gateways)."""
    argv = RequestLimits.from_args(args).to_argv() + MediaConfig.from_args(args).to_argv()
    argv += ChatOptions.from_args(args).to_argv()
    if args.blocking_threads != BLOCKING_THREADS:
        argv += ["--blocking-threads", str(args.blocking_threads)]
    return argv
