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

Pairing: each engine with a role reports its ``KVLayout`` (block size, KV dtype, model,
quantization, parallel shape, KV cache groups) in ``GetInfo``. A prefilled request goes only to a
decode engine whose layout equals its prefill engine's (``compatible``); a pair that differs is
logged once as an error naming the field (a deployment whose pools were configured apart), and
requests are not split while no prefill engine has a compatible decode engine up: they are served
whole on the decode pool instead of failing on a pull that cannot work.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Optional

from gridserve.shared.engine_client_protocol import EngineClientProtocol
from gridserve.shared.outputs import EngineCoreOutput
from gridserve.shared.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

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
        self._reported: set[tuple[str, str]] = set()  # mismatched pairs already logged

    @property
    def deployed(self) -> bool:
        """Some engine is a prefill engine: a disaggregated deployment."""
        return any(is_prefill(e) for e in self.engines)

    def prefill_first(self, params: Optional[SamplingParams], data_parallel_rank: Optional[int]) -> bool:
        """Whether a new request runs its prompt on the prefill pool first: both pools have an
        engine up, and the request can be split (not pinned, no prompt logprobs, not pooling)."""
        if params is None or data_parallel_rank is not None or params.prompt_logprobs is not None:
            return False
        decoders = [e for e in self.engines if is_decode(e) and self._is_up(e)]
        return any(self._is_up(p) and any(self.compatible(p, d) for d in decoders)
                   for p in self.engines if is_prefill(p))

    def decode_pool_for(self, producer: EngineClientProtocol) -> Pool:
        """The decode engines a request prefilled on ``producer`` may continue on (with its KV)."""
        return lambda engine: is_decode(engine) and self.compatible(producer, engine)

    def compatible(self, producer: EngineClientProtocol, consumer: EngineClientProtocol) -> bool:
        """Whether ``consumer`` can pull ``producer``'s KV: equal layouts (an engine that has not
        reported one yet is taken at its word: the decode engine still checks every transfer)."""
        mine, theirs = getattr(producer, "kv_layout", None), getattr(consumer, "kv_layout", None)
        if mine is None or theirs is None:
            return True
        mismatch = mine.mismatch(theirs)
        if mismatch is not None:
            pair = (producer.address, consumer.address)
            if pair not in self._reported:
                self._reported.add(pair)
                logger.error("prefill engine %s and decode engine %s cannot pair (%s): requests prefilled "
                             "there are not handed to it", *pair, mismatch)
        return mismatch is None

    def continuation_pool(self) -> Optional[Pool]:
        """Where a request goes whole (a failover, a request not split): the decode pool in a
        disaggregated deployment while one of its engines is reachable; None (any engine) else."""
        if self.deployed and any(is_decode(e) and e.ready.is_set() for e in self.engines):
            return is_decode
        return None

    @staticmethod
    def _is_up(engine: EngineClientProtocol) -> bool:
        return engine.ready.is_set() and engine.serving


def first_token(output: EngineCoreOutput) -> EngineCoreOutput:
    """A prefill engine's final output of a prefilled request as the client's stream sees it: the
    first token of a request that goes on (on a decode engine)."""
    return replace(output, finish_reason=None, stop_reason=None, kv_transfer_params=None)
