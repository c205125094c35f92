"""``GatewayService``: the gateway's request handling, free of protobuf.

A request is validated and tokenized (``InputProcessor``), fanned out into ``n`` engine requests
(``child_requests``), sent to the engine the ``Router`` picks by load among the ready ones, and
followed step by step: each engine batch goes through an ``OutputProcessor`` (incremental
detokenization, stop strings, logprobs) and yields a ``StreamChunk`` with what every sample added.
Text that might still turn out to be the start of a stop string is held back until it cannot. When
the caller goes away (client cancel, deadline, error) before the end, the engine requests are
aborted, which frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

from gridserve.services.gateway.observability import GatewayMetrics, RequestObservation
from gridserve.services.gateway.processor import (
    InputProcessor,
    OutputProcessor,
    PromptType,
    child_requests,
)
from gridserve.services.gateway.router import Router
from gridserve.shared.errors import EngineDeadError
from gridserve.shared.observability.tracing import Tracing
from gridserve.shared.outputs import Logprob, RequestOutput
from gridserve.shared.rpc.engine_client import EngineClient
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
                 max_model_len: int, vocab_size: int, max_logprobs: int,
                 metrics: Optional[GatewayMetrics] = None, tracing: Optional[Tracing] = None) -> None:
        self.tokenizer = tokenizer
        self.engines = engines
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.input_processor = InputProcessor(tokenizer, max_model_len, vocab_size, max_logprobs)
        self._in_flight = 0
        self._idle = threading.Condition()
        self.draining = False
        self.router = Router(len(engines))
        self.metrics = metrics
        self.tracing = tracing
        self._engine_labels = {id(e): str(i) for i, e in enumerate(engines)}  # index in --engines

    # ---- generation -----------------------------------------------------------------------------
    def generate(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str = "",
        on_done: Callable[[Callable[[], None]], Any] = lambda fn: None,
        traceparent: str = "",
        data_parallel_rank: Optional[int] = None,
    ) -> Iterator[StreamChunk]:
        """Stream one request, blocking the calling thread between steps; ``on_done`` registers a
        callback run when the caller goes away; ``traceparent`` (W3C) makes the request's spans
        part of the caller's trace."""
        outputs: queue.SimpleQueue = queue.SimpleQueue()
        stream = _Stream(self, prompt, params, request_id, traceparent, data_parallel_rank, outputs)
        on_done(lambda: outputs.put(_CANCELLED))
        error = None
        try:
            with stream.observation.phase("generate_and_detokenize"):
                # The engine client lives on the server's loop: this thread waits for the sends.
                asyncio.run_coroutine_threadsafe(stream.send(), stream.engine.loop).result()
                while not stream.finished:
                    item = outputs.get()
                    if item is _CANCELLED:
                        return
                    yield stream.on_item(item)
        except BaseException as exc:
            error = exc if not isinstance(exc, GeneratorExit) else None
            raise
        finally:
            stream.close(error)

    async def generate_async(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str = "",
        traceparent: str = "",
        data_parallel_rank: Optional[int] = None,
    ) -> AsyncIterator[StreamChunk]:
        """``generate`` on an asyncio loop: the engine client hands each step's outputs to the loop,
        so one thread serves every stream. Tokenization runs in a thread; cancelling the task (the
        caller went away) aborts the engine requests."""
        outputs: asyncio.Queue = asyncio.Queue()
        stream = await asyncio.to_thread(_Stream, self, prompt, params, request_id, traceparent,
                                         data_parallel_rank, outputs)
        error = None
        try:
            with stream.observation.phase("generate_and_detokenize"):
                await stream.send()
                while not stream.finished:
                    yield stream.on_item(await outputs.get())
        except BaseException as exc:
            error = exc if not isinstance(exc, (GeneratorExit, asyncio.CancelledError)) else None
            raise
        finally:
            stream.close(error)

    def complete(self, prompt: PromptType, params: SamplingParams, request_id: str = "",
                 on_done: Callable[[Callable[[], None]], Any] = lambda fn: None,
                 traceparent: str = "", data_parallel_rank: Optional[int] = None) -> RequestOutput:
        final = None
        for chunk in self.generate(prompt, params, request_id, on_done, traceparent, data_parallel_rank):
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
    def _pick_engine(self, data_parallel_rank: Optional[int] = None) -> EngineClient:
        """The engine for a new request: the ``Router``'s choice by load (or the explicit rank)."""
        ready = [e.ready.is_set() for e in self.engines]
        in_flight = [e.num_in_flight for e in self.engines]
        return self.engines[self.router.choose(ready, in_flight, data_parallel_rank)]

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


class _Stream:
    """One request on its way through the gateway: validated and tokenized, fanned out into its
    ``n`` engine requests on the engine the router picks, then each engine output turned into a
    ``StreamChunk``. ``outputs`` (anything with ``put_nowait``) receives the engine's outputs."""

    def __init__(self, service: GatewayService, prompt: PromptType, params: SamplingParams, request_id: str,
                 traceparent: str, data_parallel_rank: Optional[int], outputs: Any) -> None:
        if service.draining:
            raise EngineDeadError("the gateway is shutting down")
        self.service = service
        client_id = request_id
        self.request_id = request_id or uuid.uuid4().hex
        # Engine-side ids stay unique whatever the client sends; a gateway-made id is used as is, so
        # the id the client sees is the one in every role's logs and spans.
        self.parent_id = uuid.uuid4().hex if client_id else self.request_id
        self.observation = RequestObservation(self.request_id, traceparent, service.metrics, service.tracing)
        try:
            with self.observation.phase("validate_and_tokenize"):
                self.processed = service.input_processor.process(prompt, params)
            self.engine = service._pick_engine(data_parallel_rank)
        except Exception as exc:
            self.observation.end({}, 0, exc)
            raise
        self.engine_ids = child_requests(self.parent_id, self.processed.sampling_params)
        self.processor = OutputProcessor(service.tokenizer)
        self.processor.add_request(self.parent_id, self.processed, self.engine_ids)
        self.samples = self.processor.parents[self.parent_id].samples
        for child_id, _, _ in self.engine_ids:
            self.engine.register(child_id, outputs)
        self.sent = {child_id: _SentState() for child_id, _, _ in self.engine_ids}
        self.finished = False
        service._enter()
        self.observation.on_engine(service._engine_labels.get(id(self.engine), self.engine.address))

    async def send(self) -> None:
        """Add the engine requests (on the engine client's loop)."""
        for child_id, _, child_params in self.engine_ids:
            await self.engine.add_request(child_id, self.processed.prompt_token_ids, child_params,
                                    parent_request_id=self.request_id, traceparent=self.observation.traceparent)

    def abort(self, request_ids: list[str]) -> None:
        """Abort engine requests without waiting (from the loop or any thread)."""
        asyncio.run_coroutine_threadsafe(self.engine.abort(request_ids), self.engine.loop)

    def on_item(self, item: Any) -> StreamChunk:
        """The chunk one engine output adds (an exception from the engine client is raised)."""
        if isinstance(item, Exception):
            raise item
        self.observation.on_output(item)
        done, to_abort = self.processor.process_outputs([item])
        if to_abort:
            self.abort(to_abort)
        sample = self.samples.get(item.request_id)
        if sample is not None and sample.finish_reason is not None and not self.sent[item.request_id].finished:
            self.observation.on_sample_finished(sample.finish_reason)
        self.finished = bool(done)
        deltas = [_delta(self.samples[c], self.sent[c]) for c in self.sent]
        return StreamChunk(self.request_id, [d for d in deltas if d is not None],
                           len(self.processed.prompt_token_ids), done[0] if done else None)

    def close(self, error: Optional[BaseException]) -> None:
        """Stop listening; abort the engine requests if the request did not finish."""
        for child_id in self.sent:
            self.engine.unregister(child_id)
        if not self.finished:
            self.abort(list(self.sent))
        self.service._exit()
        self.observation.end(self.samples, len(self.processed.prompt_token_ids), error)


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
