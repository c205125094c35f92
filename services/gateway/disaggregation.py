"""``EnginePools``: which engines prefill and which decode (disaggregated prefill / decode).

``gridserve serve --disaggregated P:D`` starts P engines with ``--kv-role kv_producer`` (prefill)
and D with ``--kv-role kv_consumer`` (decode); each engine says its role in ``GetInfo``, which the
gateway's engine client reads when its output stream opens, so the gateway needs no list of pools.
While a prefill engine and a decode engine are both up, a new request goes to the prefill pool
first, prefill-only: the prefill engine runs the prompt, samples the first token and finishes with
the ``KVTransferParams`` of the blocks it holds. The gateway streams that token to the client
(``first_token``: the output as the client sees it, not finished) and adds the request to the
decode pool as a continuation (the first token as its output so far) with those params: the decode
engine pulls the prompt's KV from the prefill engine's worker and generates the rest, so the
client sees one stream. The router picks within each pool by ``load`` or ``prefix``, as it does
among plain engines.

Failure rules: a prefill engine lost before it answers, or no decode engine up to hand off to: the
request continues on the decode pool with no params (plain serving; ``continuation_pool``); a decode
engine's failed pull (the prefill engine died mid-transfer, the deadline passed) makes it compute the
prompt itself; a decode engine lost mid-stream: the gateway's failover continues the stream on
another decode engine; a request that ends at its first token (a stop string the gateway applies)
or whose client leaves after the hand-off is aborted on the prefill engine, which releases the held
blocks at once (not at the transfer's deadline). Requests that cannot be split go to the decode pool whole: ones pinned to an
engine (``data_parallel_rank``), ones asking for prompt logprobs (the decode engine computes them).
An in-process engine (``LocalEngineClient``) has no role: a plain engine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Optional

from gridserve.shared.engine_client_protocol import EngineClientProtocol
from gridserve.shared.outputs import EngineCoreOutput
from gridserve.shared.sampling_params import SamplingParams

PRODUCER = "kv_producer"

Pool = Callable[[EngineClientProtocol], bool]


def kv_role(engine: EngineClientProtocol) -> str:
    """The engine's ``--kv-role`` as it reported it ("" for a plain or in-process engine)."""
    return getattr(engine, "kv_role", "")


def is_prefill(engine: EngineClientProtocol) -> bool:
    return kv_role(engine) == PRODUCER


def is_decode(engine: EngineClientProtocol) -> bool:
    """Every engine but a prefill-only one decodes (kv_consumer, kv_both, plain)."""
    return not is_prefill(engine)


class EnginePools:
    """The prefill and decode pools among a gateway's engines (by the roles they report)."""

    def __init__(self, engines: list[EngineClientProtocol]) -> None:
        self.engines = engines

    @property
    def deployed(self) -> bool:
        """Some engine is a prefill engine: a disaggregated deployment."""
        return any(is_prefill(e) for e in self.engines)

    def prefill_first(self, params: Optional[SamplingParams], data_parallel_rank: Optional[int]) -> bool:
        """Whether a new request runs its prompt on the prefill pool first: both pools have an
        engine up, and the request can be split (not pinned, no prompt logprobs, not pooling)."""
        if params is None or data_parallel_rank is not None or params.prompt_logprobs is not None:
            return False
        return self._up(is_prefill) and self._up(is_decode)

    def continuation_pool(self) -> Optional[Pool]:
        """Where a request goes whole (a failover, a request not split): the decode pool in a
        disaggregated deployment while one of its engines is reachable; None (any engine) else."""
        if self.deployed and any(is_decode(e) and e.ready.is_set() for e in self.engines):
            return is_decode
        return None

    def _up(self, pool: Pool) -> bool:
        return any(pool(e) and e.ready.is_set() and e.serving for e in self.engines)


def first_token(output: EngineCoreOutput) -> EngineCoreOutput:
    """A prefill engine's final output of a prefilled request as the client's stream sees it: the
    first token of a request that goes on (on a decode engine)."""
    return replace(output, finish_reason=None, stop_reason=None, kv_transfer_params=None)
