"""``GatewayService``: the gateway's request handling, free of protobuf.

A request is validated and tokenized (``InputProcessor``), fanned out into ``n`` engine requests
(``child_requests``), sent to an engine picked round-robin among the ready ones, and followed step by
step: each engine batch goes through an ``OutputProcessor`` (incremental detokenization, stop
strings, logprobs) and yields a ``StreamChunk`` with what every sample added. Text that might
still turn out to be the start of a stop string is held back until it cannot. When the caller goes
away (client cancel, deadline, error) before the end, the engine requests are aborted, which frees
their KV blocks.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

from gridserve.services.gateway.engine_client import EngineClient
from gridserve.services.gateway.processor import (
    InputProcessor,
    OutputProcessor,
    PromptType,
    child_requests,
)
from gridserve.shared.errors import EngineDeadError
from gridserve.shared.outputs import Logprob, RequestOutput
from gridserve.shared.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_CANCELLED = object()


@dataclass
class SampleDelta:
    """What one sample (``index``) added in one step."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: Optional[str] = None
    stop_reason: Any = None


@dataclass
class StreamChunk:
    """One step of a request; ``final`` is set on the last chunk."""

    request_id: str
    deltas: list[SampleDelta]
    num_prompt_tokens: int
    final: Optional[RequestOutput] = None


class _SentState:
    """How much of one sample the caller has already received."""

    def __init__(self) -> None:
        self.text = 0
        self.tokens = 0
        self.logprobs = 0
        self.finished = False


class GatewayService:
    """Validation, tokenization, engine selection and streaming for every gateway RPC."""

    def __init__(self, tokenizer: Any, engines: list[EngineClient], model_name: str,
                 max_model_len: int, vocab_size: int, max_logprobs: int) -> None:
        self.tokenizer = tokenizer
        self.engines = engines
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.input_processor = InputProcessor(tokenizer, max_model_len, vocab_size, max_logprobs)
        self._next_engine = itertools.count()
        self._in_flight = 0
        self._idle = threading.Condition()
        self.draining = False

    # ---- generation -----------------------------------------------------------------------------
    def generate(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str = "",
        on_done: Callable[[Callable[[], None]], Any] = lambda fn: None,
    ) -> Iterator[StreamChunk]:
        """Stream one request; ``on_done`` registers a callback run when the caller goes away."""
        if self.draining:
            raise EngineDeadError("the gateway is shutting down")
        processed = self.input_processor.process(prompt, params)
        request_id = request_id or uuid.uuid4().hex
        parent_id = uuid.uuid4().hex  # engine-side ids stay unique whatever the client sends
        engine_ids = child_requests(parent_id, processed.sampling_params)
        engine = self._pick_engine()
        processor = OutputProcessor(self.tokenizer)
        processor.add_request(parent_id, processed, engine_ids)
        samples = processor.parents[parent_id].samples
        outputs: queue.SimpleQueue = queue.SimpleQueue()
        on_done(lambda: outputs.put(_CANCELLED))
        for child_id, _, _ in engine_ids:
            engine.register(child_id, outputs)
        sent = {child_id: _SentState() for child_id, _, _ in engine_ids}
        self._enter()
        finished = False
        try:
            for child_id, _, child_params in engine_ids:
                engine.add_request(child_id, processed.prompt_token_ids, child_params)
            while not finished:
                item = outputs.get()
                if item is _CANCELLED:
                    return
                if isinstance(item, Exception):
                    raise item
                done, to_abort = processor.process_outputs([item])
                if to_abort:
                    engine.abort(to_abort)
                finished = bool(done)
                deltas = [_delta(samples[c], sent[c]) for c in sent]
                yield StreamChunk(request_id, [d for d in deltas if d is not None],
                                  len(processed.prompt_token_ids), done[0] if done else None)
        finally:
            for child_id in sent:
                engine.unregister(child_id)
            if not finished:
                engine.abort(list(sent))
            self._exit()

    def complete(self, prompt: PromptType, params: SamplingParams, request_id: str = "",
                 on_done: Callable[[Callable[[], None]], Any] = lambda fn: None) -> RequestOutput:
        final = None
        for chunk in self.generate(prompt, params, request_id, on_done):
            final = chunk.final or final
        if final is None:
            raise EngineDeadError("the request ended without a result")
        return final

    def chat_prompt(self, messages: list[dict[str, str]], chat_template: Optional[str],
                    add_generation_prompt: bool) -> dict:
        ids = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, chat_template=chat_template, tokenize=True
        )
        return {"prompt_token_ids": list(ids)}

    # ---- engines and draining -------------------------------------------------------------------
    def _pick_engine(self) -> EngineClient:
        ready = [e for e in self.engines if e.ready.is_set()]
        if not ready:
            raise EngineDeadError("no engine is available")
        return ready[next(self._next_engine) % len(ready)]

    def is_ready(self) -> bool:
        return not self.draining and any(e.ready.is_set() for e in self.engines)

    def _enter(self) -> None:
        with self._idle:
            self._in_flight += 1

    def _exit(self) -> None:
        with self._idle:
            self._in_flight -= 1
            self._idle.notify_all()

    def drain(self, timeout: float) -> None:
        """Refuse new requests and wait up to ``timeout`` s for the in-flight ones to finish."""
        self.draining = True
        with self._idle:
            self._idle.wait_for(lambda: self._in_flight == 0, timeout=timeout)
        for engine in self.engines:
            engine.close()


def _delta(sample: Any, sent: _SentState) -> Optional[SampleDelta]:
    """What ``sample`` (an OutputProcessor sample state) gained since ``sent``; None if nothing."""
    if sent.finished:
        return None
    finished = sample.finish_reason is not None
    text = sample.text if finished else _hold_back(sample.text, sample.params.stop)
    delta = SampleDelta(
        index=sample.index,
        text=text[sent.text:],
        token_ids=sample.token_ids[sent.tokens:],
        logprobs=(sample.logprobs or [])[sent.logprobs:],
        finish_reason=sample.finish_reason,
        stop_reason=sample.stop_reason,
    )
    sent.text = max(sent.text, len(text))
    sent.tokens = len(sample.token_ids)
    sent.logprobs = len(sample.logprobs or [])
    sent.finished = finished
    if not (delta.text or delta.token_ids or finished):
        return None
    return delta


def _hold_back(text: str, stops: list[str]) -> str:
    """``text`` minus a tail that could still grow into a stop string."""
    if not stops:
        return text
    return text[: max(0, len(text) - (max(len(s) for s in stops) - 1))]
