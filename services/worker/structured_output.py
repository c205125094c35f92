"""Per-step grammar masks for structured-output requests (llguidance matchers).

Each structured request owns an ``LLMatcher`` (a deep copy of a per-spec template, so a spec is
compiled once). Every step :meth:`StructuredOutputManager.apply_bitmask` fills one int32 bitmask
for the batch's structured rows (llguidance's thread pool when there are several) and sets the
disallowed logits of those rows to ``-inf``; other rows are not touched. After sampling,
:meth:`StructuredOutputManager.accept_tokens` advances the matchers. A matcher whose grammar is
complete allows only EOS, so the request ends with finish reason ``stop``.

Speculative decoding: a structured request's drafts are cut before the first token its grammar
refuses (:meth:`StructuredOutputManager.valid_prefix`). A verify step samples the request at each
draft position; row ``i``'s mask is the grammar's after the first ``i`` drafts: the matcher
consumes the drafts one by one while the masks are filled, then rolls them back, and after
sampling consumes only the accepted run. A rejected draft thus never enters the matcher. A spec that does not
compile, or a token that breaks a grammar, is that request's failure (``add_request`` raises,
``accept_tokens`` returns it): the model runner fails that request alone.

``GRIDSERVE_TEST_GRAMMAR_FAULT`` (tests only, with ``GRIDSERVE_TEST_HOOKS=1``) makes every request whose spec text contains that
string fail on its first accepted token, as a grammar that breaks inside the worker would.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Optional

import llguidance
import numpy as np
import torch

from gridserve.shared import envs
from gridserve.shared.sampling_params import StructuredOutputsParams
from gridserve.shared.structured_output import compile_grammar, ll_tokenizer, spec_key

logger = logging.getLogger(__name__)

_MAX_TEMPLATES = 256
_NUMPY_DTYPES = (torch.float32, torch.float16, torch.float64)
_TEST_FAULT = envs.GRIDSERVE_TEST_GRAMMAR_FAULT  # read once; only with GRIDSERVE_TEST_HOOKS=1


class StructuredOutputManager:
    """Grammar matchers of the worker's structured requests, keyed by request id."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: Optional[int] = None) -> None:
        self.vocab_size = max(vocab_size, len(tokenizer))
        self.ll_tokenizer = ll_tokenizer(
            tokenizer, n_vocab=self.vocab_size, eos_token_id=eos_token_id
        )
        self.eos_token_id = self.ll_tokenizer.eos_token
        self.num_words = (self.vocab_size + 31) // 32
        self._matchers: dict[str, llguidance.LLMatcher] = {}
        self._templates: dict[str, llguidance.LLMatcher] = {}  # grammar -> fresh matcher
        self._bitmask = torch.zeros((0, self.num_words), dtype=torch.int32)
        self._executor: Optional[llguidance.LLExecutor] = None
        self._faulty: set[str] = set()  # GRIDSERVE_TEST_GRAMMAR_FAULT: requests made to fail

    @property
    def has_requests(self) -> bool:
        return bool(self._matchers)

    def add_request(
        self, req_id: str, params: StructuredOutputsParams, prior_output_tokens: Sequence[int] = ()
    ) -> None:
        """Start ``req_id``'s matcher; replay ``prior_output_tokens`` for a request resumed after preemption.

        Raises ``ValueError`` when the spec does not compile (the gateway validates specs, so only a
        client that bypassed it gets here) or the prior tokens break it; nothing is kept then.
        """
        template = self._template(compile_grammar(params))
        self._matchers[req_id] = template.deep_copy()
        if _TEST_FAULT and _TEST_FAULT in spec_key(params)[1]:
            self._faulty.add(req_id)
        failures = self.accept_tokens([req_id] * len(prior_output_tokens), prior_output_tokens)
        if failures:
            self.remove(req_id)
            raise ValueError(failures[req_id])

    def remove(self, req_id: str) -> None:
        self._matchers.pop(req_id, None)
        self._faulty.discard(req_id)

    def clear(self) -> None:
        self._matchers.clear()
        self._faulty.clear()

    def valid_prefix(self, req_id: str, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` (drafts) the request's grammar accepts in a row from its state
        now (all of them for a request without a grammar); the matcher does not move."""
        matcher = self._matchers.get(req_id)
        if matcher is None or not tokens:
            return len(tokens)
        return matcher.validate_tokens(list(tokens))

    def apply_bitmask(self, logits: torch.Tensor, req_ids: Sequence[str],
                      drafts: Optional[dict[str, list[int]]] = None) -> None:
        """Mask, in place, the tokens each structured row's grammar forbids (row ``i`` is ``req_ids[i]``).
        A request with ``drafts`` has ``len(drafts) + 1`` consecutive rows, row ``j`` masked by the
        grammar after its first ``j`` drafts."""
        rows = [i for i, req_id in enumerate(req_ids) if req_id in self._matchers]
        if not rows:
            return
        drafted = {req_ids[i] for i in rows} & set(drafts or ())
        if not drafted:
            bitmask = self._fill([self._matchers[req_ids[i]] for i in rows])
        else:
            bitmask = self._fill_with_drafts([req_ids[i] for i in rows], drafts)
        # Unpack and mask in numpy: single-threaded, so it never waits on a busy intra-op thread pool.
        width = logits.shape[-1]
        known = min(width, self.vocab_size)
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, count=known, bitorder="little")
        forbidden = np.zeros((logits.shape[0], width), dtype=np.bool_)
        forbidden[rows, :known] = bits == 0
        forbidden[rows, known:] = True  # ids past the vocabulary (padded logits) are never allowed
        if logits.device.type == "cpu" and logits.dtype in _NUMPY_DTYPES:
            np.copyto(logits.numpy(), -np.inf, where=forbidden)
        else:
            logits.masked_fill_(
                torch.from_numpy(forbidden).to(logits.device, non_blocking=True), float("-inf")
            )

    def accept_tokens(self, req_ids: Sequence[str], token_ids: Sequence[int]) -> dict[str, str]:
        """Advance each structured request's matcher by the token it just sampled; the requests
        whose grammar broke (request id -> why), whose matchers are dropped."""
        failures: dict[str, str] = {}
        for req_id, token in zip(req_ids, token_ids):
            matcher = self._matchers.get(req_id)
            if matcher is None or req_id in failures or matcher.is_stopped():  # complete: only EOS is allowed
                continue
            if req_id in self._faulty:
                failures[req_id] = "injected grammar fault (GRIDSERVE_TEST_GRAMMAR_FAULT)"
            elif not matcher.consume_token(token):
                failures[req_id] = f"token {token} breaks its grammar: {matcher.get_error()}"
        for req_id in failures:
            self.remove(req_id)
        return failures

    # ---- internals -----------------------------------------------------------------------
    def _fill_with_drafts(self, row_req_ids: list[str], drafts: dict[str, list[int]]) -> torch.Tensor:
        """One mask per structured row where some requests have drafts (consecutive rows)."""
        plain = [j for j, req_id in enumerate(row_req_ids) if req_id not in drafts]
        bitmask = torch.empty((len(row_req_ids), self.num_words), dtype=torch.int32)
        if plain:
            bitmask[plain] = self._fill([self._matchers[row_req_ids[j]] for j in plain])
        j = 0
        while j < len(row_req_ids):
            req_id = row_req_ids[j]
            n = len(drafts[req_id]) + 1 if req_id in drafts else 1
            if req_id in drafts:
                self._fill_draft_rows(self._matchers[req_id], drafts[req_id], bitmask[j:j + n])
            j += n
        return bitmask

    def _fill_draft_rows(self, matcher: llguidance.LLMatcher, drafts: Sequence[int], out: torch.Tensor) -> None:
        """Row ``j`` of ``out``: the mask after the first ``j`` drafts (the matcher consumes them,
        then rolls back). Past a draft the grammar refuses (or once it is complete) the rows repeat
        the last mask: the target's sample differs from a refused draft, so the run ends first."""
        row_bytes = self.num_words * 4
        consumed, going = 0, True
        for j in range(out.shape[0]):
            if j and going:
                going = not matcher.is_stopped() and matcher.try_consume_tokens([drafts[j - 1]]) == 1
                consumed += going
            if j and not going:
                out[j] = out[j - 1]
            else:
                matcher.unsafe_compute_mask_ptr(out[j].data_ptr(), row_bytes)
        if consumed:
            matcher.rollback(consumed)

    def _template(self, grammar: str) -> llguidance.LLMatcher:
        template = self._templates.get(grammar)
        if template is None:
            template = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
            if template.is_error():  # the gateway validates specs, so this is a bug or a bypass
                raise ValueError(f"invalid structured-output grammar: {template.get_error()}")
            if len(self._templates) >= _MAX_TEMPLATES:
                self._templates.pop(next(iter(self._templates)))
            self._templates[grammar] = template
        return template

    def _fill(self, matchers: list[llguidance.LLMatcher]) -> torch.Tensor:
        """Fill one bitmask row per matcher (bit ``t`` of row ``r`` set = token ``t`` allowed)."""
        if self._bitmask.shape[0] < len(matchers):
            self._bitmask = torch.zeros(
                (max(len(matchers), 2 * self._bitmask.shape[0]), self.num_words), dtype=torch.int32
            )
        bitmask = self._bitmask[: len(matchers)]
        row_bytes = self.num_words * 4
        if len(matchers) == 1:
            matchers[0].unsafe_compute_mask_ptr(bitmask.data_ptr(), row_bytes)
        else:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            self._executor.unsafe_compute_mask_ptr(
                [(m, i) for i, m in enumerate(matchers)],
                bitmask.data_ptr(),
                row_bytes,
                len(matchers),
            )
        return bitmask
