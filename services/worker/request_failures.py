"""``RequestFailures``: requests that failed on their own inside the worker (step isolation).

An error that belongs to one request — a token id outside the vocabulary in its prompt, logit bias,
allowed or bad words (only a client that bypassed the gateway's validation sends one), a grammar
that does not compile or breaks — must end that request alone, not the step. The model runner
records it here and reports it in the step's ``ModelRunnerOutput.failed``; the engine finishes the
request with finish reason ``error`` and tells the worker to forget it.

Two kinds, because every rank of a parallel group must run the same batch: a *rejected* request
failed a check every rank makes on the same data (``check_new_request``), so every rank leaves it
out of the batch; a *failed* one failed on the output rank only (its grammar), so it stays in the
batch and only its samples are withheld. Either way no sample of it is reported until the engine
tells the worker to forget it.
"""

from __future__ import annotations

import logging

from gridserve.shared.errors import InvalidArgumentError
from gridserve.shared.scheduler_output import NewRequestData

logger = logging.getLogger(__name__)


class RequestFailures:
    """The worker's failed requests: reported once, withheld until forgotten."""

    def __init__(self) -> None:
        self._unreported: dict[str, str] = {}
        self.withheld: set[str] = set()  # no sample of these is reported
        self.rejected: set[str] = set()  # left out of every batch (a subset of ``withheld``)

    def reject(self, req_id: str, error: str) -> None:
        """A check every rank makes failed: the request leaves the batch on every rank."""
        self.rejected.add(req_id)
        self.fail(req_id, error)

    def fail(self, req_id: str, error: str) -> None:
        """The request failed (on this rank): report ``error`` once and withhold its samples."""
        if req_id in self.withheld:
            return
        logger.warning("request %s failed in the worker: %s", req_id, error)
        self.withheld.add(req_id)
        self._unreported[req_id] = error

    def forget(self, req_id: str) -> None:
        self.withheld.discard(req_id)
        self.rejected.discard(req_id)
        self._unreported.pop(req_id, None)

    def take(self) -> dict[str, str]:
        """The failures not reported yet (request id -> error), now reported."""
        taken, self._unreported = self._unreported, {}
        return taken

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.withheld


def check_new_request(new: NewRequestData, vocab_size: int) -> None:
    """Raise ``InvalidArgumentError`` naming the field when a token id of ``new`` is outside
    ``[0, vocab_size)``: it would index the embedding or the logits out of range and fail the step."""
    params = new.sampling_params
    fields = {
        "prompt_token_ids": new.prompt_token_ids,
        "output_token_ids": new.output_token_ids,
        "sampling_params.stop_token_ids": params.stop_token_ids,
        "sampling_params.logit_bias": list(params.logit_bias or {}),
        "sampling_params.allowed_token_ids": list(params.allowed_token_ids or []),
        "sampling_params.bad_words_token_ids": [t for word in params.bad_words_token_ids for t in word],
    }
    for field, ids in fields.items():
        bad = next((t for t in ids if not 0 <= int(t) < vocab_size), None)
        if bad is not None:
            raise InvalidArgumentError(field, f"token id {bad} is out of range [0, {vocab_size})")
