"""``GatewayService``: the gateway's request handling, free of protobuf.

A request is validated and tokenized (``InputProcessor``), fanned out into ``n`` engine requests
(``child_requests``), sent to the engine the ``Router`` picks by load (and, with ``--routing-policy
prefix``, by the prompt blocks each engine has cached) among the ready ones, and
followed step by step: each engine batch goes through an ``OutputProcessor`` (incremental
detokenization, stop strings, logprobs) and yields a ``StreamChunk`` with what every sample added.
Text that might still turn out to be the start of a stop string is held back until it cannot. When
the caller goes away (client cancel, deadline, error) before the end, the engine requests are
aborted, which frees their KV blocks. One path, on the gateway's asyncio loop, serves every RPC.

Admission: an engine whose waiting queue is full refuses the add (``--max-waiting-requests``); the
request then goes to the next engine the router picks, and when every ready engine refused it the
caller gets ``ResourceExhaustedError`` (RESOURCE_EXHAUSTED / HTTP 429 with ``Retry-After``). Before
that, a request's size is checked against its ``RequestBudget`` (``limits.py``: sequences, prompt
tokens in flight): beyond it, ``InvalidArgumentError`` (HTTP 400) and nothing reaches an engine.
Deadlines: each request ends by the earlier of the caller's deadline (gRPC) and ``--request-timeout``;
at expiry it fails with ``DeadlineExceededError`` (DEADLINE_EXCEEDED / HTTP 504) and its engine
requests are aborted. The expiry is one timer per request that drops the error into the request's
output queue: the served path pays nothing per token.

Failover: when an engine's output stream breaks (it died), each of its unfinished samples goes on
as a *continuation* on a live engine (the same engine id, the prompt, the tokens the gateway
already has as output, the same seed — the gateway draws one for every unseeded sampled request,
so the continuation samples the same stream) while this request's ``OutputProcessor`` keeps the
detokenizer, stop-string, logprob and usage state: the client sees a pause, not a duplicated or
missing token. ``n > 1`` samples fail over one by one; without a live engine within
``GRIDSERVE_FAILOVER_TIMEOUT_S`` the request ends with UNAVAILABLE.

Disaggregated prefill / decode (``disaggregation.py``): with prefill engines and decode engines up,
a new request runs prefill-only on the prefill pool; its first token is streamed and the request
continues on the decode pool with the prefill engine's ``KVTransferParams`` (``_Stream.hand_off``);
failovers go to the decode pool. A request that ends at its first token (a stop string), or whose
client leaves after the hand-off, is aborted on the prefill engine too: it frees the held KV now.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Optional, TypeVar

import grpc

from gridserve.services.gateway.chat_options import ChatOptions
from gridserve.services.gateway.disaggregation import (
    EnginePools,
    Pool,
    first_token,
    is_prefill,
)
from gridserve.services.gateway.limits import RequestBudget, RequestLimits, current_budget
from gridserve.services.gateway.lora import LoraAdapters, not_found
from gridserve.services.gateway.media_loader import MediaLoader
from gridserve.services.gateway.multimodal import MultiModalProcessor
from gridserve.services.gateway.observability import GatewayMetrics, RequestObservation
from gridserve.services.gateway.pooling import ModelInfo, PoolingInput
from gridserve.services.gateway.processor import (
    InputProcessor,
    OutputProcessor,
    ProcessedPrompt,
    PromptType,
    child_requests,
)
from gridserve.services.gateway.router import Router
from gridserve.shared import envs
from gridserve.shared.engine_client_protocol import EngineClientProtocol
from gridserve.shared.errors import (
    DeadlineExceededError,
    EngineDeadError,
    RequestFailedError,
    ResourceExhaustedError,
)
from gridserve.shared.kv_transfer import KVTransferParams
from gridserve.shared.observability.tracing import Tracing
from gridserve.shared.outputs import EngineCoreOutput, FinishReason, Logprob, RequestOutput
from gridserve.shared.pooling import PoolingParams
from gridserve.shared.prefix_hash import digest_key, prompt_block_hashes
from gridserve.shared.rpc.engine_client import EngineLostError
from gridserve.shared.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")

# How long a sample whose engine died waits for a live engine to continue on (the launcher or
# Kubernetes restarts a dead one; with DP >= 2 another one usually serves at once).
FAILOVER_POLL_S = 0.05


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
    prompt_logprobs: Optional[list] = None  # the request's, so far (with prompt_logprobs set)
    prompt_token_ids: Optional[list[int]] = None  # the prompt as the engine got it


class _SentState:
    """How much of one sample the caller has already received."""

    def __init__(self) -> None:
        self.text = 0
        self.tokens = 0
        self.logprobs = 0
        self.finished = False


class GatewayService:
    """Validation, tokenization, engine selection and streaming for every gateway RPC.

    Everything runs on the gateway's asyncio loop; blocking work (tokenization, chat templates,
    long detokenizations) goes to ``self.blocking``, a bounded thread pool of the gateway's own,
    so a slow tokenization never stalls the streams the loop serves."""

    def __init__(self, tokenizer: Any, engines: list[EngineClientProtocol], model_name: str,
                 max_model_len: int, vocab_size: int, max_logprobs: int,
                 metrics: Optional[GatewayMetrics] = None, tracing: Optional[Tracing] = None,
                 limits: Optional[RequestLimits] = None, blocking_workers: int = 8,
                 multimodal: Optional[MultiModalProcessor] = None, media: Optional[MediaLoader] = None,
                 sampling_defaults: Optional[dict[str, Any]] = None, chat_options: Optional[ChatOptions] = None,
                 model_info: Optional[ModelInfo] = None, routing_policy: str = "load") -> None:
        """``routing_policy``: how the ``Router`` picks an engine (``load`` or ``prefix``);
        ``model_info``: the model's runner and tasks (default: a generative model);
        ``multimodal``: a vision-language model's image preprocessing (None: text only);
        ``media``: the pool that loads images by URL; ``sampling_defaults``: what a request gets
        for a sampling field it leaves out (the model's generation config, from the engine);
        ``chat_options``: how chat replies are read (tool-call and reasoning parsers)."""
        self.tokenizer = tokenizer
        self.model_info = model_info or ModelInfo()
        self.chat_options = chat_options or ChatOptions()
        self.sampling_defaults = dict(sampling_defaults or {})
        self.engines = engines
        self.model_name = model_name
        self.max_model_len = max_model_len
        limits = limits or RequestLimits()
        self.limits = replace(limits, max_logprobs=min(limits.max_logprobs, max_logprobs))
        self.input_processor = InputProcessor(tokenizer, max_model_len, vocab_size, self.limits.max_logprobs,
                                              multimodal)
        self.media = media or MediaLoader()
        self.blocking = ThreadPoolExecutor(max_workers=blocking_workers, thread_name_prefix="gateway-blocking")
        self._in_flight = 0
        self._idle: Optional[asyncio.Event] = None
        self.draining = False
        self.router = Router(len(engines), routing_policy)
        self.pools = EnginePools(engines)  # disaggregated prefill / decode: the engines' kv roles
        self.metrics = metrics
        self.tracing = tracing
        self._engine_labels = {id(e): str(i) for i, e in enumerate(engines)}  # index in --engines
        self.loras = LoraAdapters(engines)  # the engines' LoRA adapters, as this gateway last saw them

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the gateway's bounded pool, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.blocking, functools.partial(fn, *args))

    # ---- generation -----------------------------------------------------------------------------
    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams,
        request_id: str = "",
        traceparent: str = "",
        data_parallel_rank: Optional[int] = None,
        timeout: Optional[float] = None,
        lora_name: Optional[str] = None,
        priority: int = 0,
        cache_salt: Optional[str] = None,
    ) -> AsyncIterator[StreamChunk]:
        """Stream one request: the engine client hands each step's outputs to the loop, so one
        thread serves every stream; ``traceparent`` (W3C) makes the request's spans part of the
        caller's trace. Cancelling the task (the caller went away) aborts the engine requests.
        ``timeout``: the caller's deadline in seconds from now (the earlier of it and
        ``--request-timeout`` ends the request). ``lora_name``: the LoRA adapter it runs on (the
        caller checked the name; None: the base model). ``priority``: its rank on engines with
        ``--scheduling-policy priority`` (lower first; the caller checked ``--allow-client-priority``).
        ``cache_salt``: only requests with the same salt share prefix-cache blocks (and the router
        hashes the prompt with it)."""
        if self.draining:
            raise EngineDeadError("the gateway is shutting down")
        self.model_info.check_generates(self.model_name)
        timeout = self._timeout(timeout)
        # A completions route's prompts share the budget it opened; anything else is one prompt.
        self.limits.check_sequences(1, params.n)
        budget = current_budget() or RequestBudget(self.limits.max_prompt_tokens_per_request)
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        request = _Request(self, request_id, traceparent)
        try:
            with request.observation.phase("validate_and_tokenize"):
                processing = self.run_blocking(self.input_processor.process, prompt, params)
                if deadline is None:
                    processed = await processing
                else:
                    processed = await _by(deadline, processing, timeout)
            tokens = len(processed.prompt_token_ids)
            budget.take(tokens)
        except BaseException as exc:
            request.observation.end({}, 0, None if isinstance(exc, asyncio.CancelledError) else exc)
            raise
        # From here to the ``try`` nothing awaits: a cancellation cannot fall between the counts
        # going up and the ``finally`` that brings them down.
        try:
            stream = _Stream(request, processed, data_parallel_rank, asyncio.Queue(), lora_name, priority,
                             cache_salt)
        except BaseException:
            budget.give_back(tokens)
            raise
        error = None
        try:
            if deadline is not None:  # the expiry arrives as the request's next output
                stream.timer = loop.call_at(deadline, stream.outputs.put_nowait, _expired(timeout))
            with stream.observation.phase("generate_and_detokenize"):
                await stream.send()
                while not stream.finished:
                    item = await stream.outputs.get()
                    if isinstance(item, EngineLostError):
                        await stream.fail_over(item)
                        continue
                    if isinstance(item, EngineCoreOutput) and item.kv_transfer_params is not None:
                        yield await stream.hand_off(item)  # prefilled: decoding goes on elsewhere
                        continue
                    yield stream.on_item(item)
        except BaseException as exc:
            error = exc if not isinstance(exc, (GeneratorExit, asyncio.CancelledError)) else None
            raise
        finally:
            stream.close(error)
            budget.give_back(tokens)

    async def complete(self, prompt: PromptType, params: SamplingParams, request_id: str = "",
                       traceparent: str = "", data_parallel_rank: Optional[int] = None,
                       timeout: Optional[float] = None, lora_name: Optional[str] = None,
                       priority: int = 0, cache_salt: Optional[str] = None) -> RequestOutput:
        """The whole result of one request."""
        final = None
        async for chunk in self.generate(prompt, params, request_id, traceparent, data_parallel_rank, timeout,
                                         lora_name, priority, cache_salt):
            final = chunk.final or final
        if final is None:
            raise EngineDeadError("the request ended without a result")
        return final

    # ---- pooling (embeddings, scores, classification) -------------------------------------------
    async def pool(self, prompt: PoolingInput, params: PoolingParams, request_id: str = "",
                   traceparent: str = "", data_parallel_rank: Optional[int] = None,
                   timeout: Optional[float] = None) -> PooledOutput:
        """One pooling request (a checked, tokenized prompt) on the engine the router picks: its
        pooler output. Admission and deadlines as ``generate``; an engine lost before it answered
        gets the request again on a live one (pooling has no state to carry over)."""
        if self.draining:
            raise EngineDeadError("the gateway is shutting down")
        timeout = self._timeout(timeout)
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        request = _Request(self, request_id, traceparent)
        call = _PoolingCall(self, request, prompt, params, data_parallel_rank)
        self._enter()
        error: Optional[BaseException] = None
        try:
            return await call.run(deadline, timeout)
        except BaseException as exc:
            error = exc if not isinstance(exc, (GeneratorExit, asyncio.CancelledError)) else None
            raise
        finally:
            call.close()
            self._exit()
            samples = {call.engine_id: call.sample} if call.engine is not None else {}  # none: it never ran
            request.observation.end(samples, len(prompt.token_ids), error)

    async def chat_prompt(self, messages: list[dict[str, Any]], chat_template: Optional[str],
                          add_generation_prompt: bool, tools: Optional[list[dict]] = None,
                          chat_template_kwargs: Optional[dict[str, Any]] = None) -> dict:
        """The conversation rendered by the chat template and tokenized (in the blocking pool);
        ``chat_template_kwargs``: further template variables."""
        ids = await self.run_blocking(functools.partial(
            self.tokenizer.apply_chat_template, messages, add_generation_prompt=add_generation_prompt,
            chat_template=chat_template, tokenize=True, tools=tools, chat_template_kwargs=chat_template_kwargs))
        return {"prompt_token_ids": list(ids)}

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(await self.run_blocking(self.tokenizer.encode, text, add_special_tokens))

    async def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return await self.run_blocking(functools.partial(self.tokenizer.decode, list(token_ids),
                                                         skip_special_tokens=skip_special_tokens))

    def _timeout(self, timeout: Optional[float]) -> Optional[float]:
        """The earlier of the caller's deadline and ``--request-timeout`` (0: none), in seconds."""
        limit = self.limits.request_timeout or None
        if timeout is None:
            return limit
        return timeout if limit is None else min(timeout, limit)

    # ---- engines and draining -------------------------------------------------------------------
    def _pick_engine(self, data_parallel_rank: Optional[int] = None,
                     refused: frozenset[int] = frozenset(), prefix_keys: Sequence[int] = (),
                     pool: Optional[Pool] = None) -> EngineClientProtocol:
        """The engine for a new request: the ``Router``'s choice by load (or the explicit rank; with
        ``prefix_keys``, by the cached prefix too) among the engines that are reachable, READY, in
        ``pool`` (disaggregated prefill / decode; None: any) and did not just refuse it. When none is
        READY (all asleep, say) a reachable one gets it and answers why it cannot serve."""
        reachable = [i not in refused and e.ready.is_set() and (pool is None or pool(e))
                     for i, e in enumerate(self.engines)]
        ready = [r and e.serving for r, e in zip(reachable, self.engines)]
        candidates = ready if data_parallel_rank is None and any(ready) else reachable
        in_flight = [e.num_in_flight for e in self.engines]
        return self.engines[self.router.choose(candidates, in_flight, data_parallel_rank, prefix_keys)]

    def _prefix_keys(self, processed: ProcessedPrompt, lora_name: Optional[str],
                     cache_salt: Optional[str] = None) -> list[int]:
        """The prompt's full blocks as the engines' digests name them (prefix routing; empty when the
        router does not route by prefix, or the adapter's engine id is not known here)."""
        block_size = self.router.block_size
        if block_size is None:
            return []
        lora_key = None
        if lora_name is not None:
            adapter = self.loras.table.adapters.get(lora_name)
            if adapter is None or not adapter.int_id:
                return []
            lora_key = (adapter.name, adapter.int_id)
        hashes = prompt_block_hashes(processed.prompt_token_ids, block_size, cache_salt, lora_key,
                                     processed.mm_features)
        return [digest_key(h) for h in hashes]

    def is_ready(self) -> bool:
        """Whether some engine can take a new request now: reachable and READY, or RECOVERING (it
        queues requests while its workers are rebuilt: they pause, as its streams do)."""
        return not self.draining and any(e.ready.is_set() and (e.serving or e.recovering) for e in self.engines)

    @property
    def in_flight(self) -> int:
        """Requests between tokenization and their end (the drain waits for zero)."""
        return self._in_flight

    def _enter(self) -> None:
        self._in_flight += 1

    def _exit(self) -> None:
        self._in_flight -= 1
        if self._in_flight == 0 and self._idle is not None:
            self._idle.set()

    async def drain(self, timeout: float) -> None:
        """Refuse new requests and wait up to ``timeout`` s for the in-flight ones to finish."""
        self.draining = True
        if self._in_flight:
            self._idle = asyncio.Event()
            try:
                await asyncio.wait_for(self._idle.wait(), timeout)
            except asyncio.TimeoutError:
                logger.warning("drain: %d requests still running after %.1fs", self._in_flight, timeout)
        self.blocking.shutdown(wait=False, cancel_futures=True)  # main closes the engine clients
        self.media.close()


class _Request:
    """A request's ids and observation, before its prompt is processed."""

    def __init__(self, service: GatewayService, request_id: str, traceparent: str) -> None:
        self.service = service
        self.request_id = request_id or uuid.uuid4().hex
        # Engine-side ids stay unique whatever the client sends; a gateway-made id is used as is, so
        # the id the client sees is the one in every role's logs and spans.
        self.parent_id = uuid.uuid4().hex if request_id else self.request_id
        self.observation = RequestObservation(self.request_id, traceparent, service.metrics, service.tracing)


@dataclass
class PooledOutput:
    """A pooling request's result: the pooler output (an embedding, or a classifier's scores)."""

    request_id: str
    values: list[float]
    num_prompt_tokens: int


@dataclass
class _PooledSample:
    """What ``RequestObservation.end`` reads of a sample."""

    finish_reason: Optional[str] = None
    token_ids: list[int] = field(default_factory=list)


class _PoolingCall:
    """One pooling request's engine request: added where the router says (the next engine when its
    queue is full), waited for, added again on a live engine when its engine is lost."""

    def __init__(self, service: GatewayService, request: _Request, prompt: PoolingInput, params: PoolingParams,
                 data_parallel_rank: Optional[int]) -> None:
        self.service = service
        self.request = request
        self.prompt = prompt
        self.params = params
        self.rank = data_parallel_rank
        self.outputs: asyncio.Queue = asyncio.Queue()
        self.engine: Optional[EngineClientProtocol] = None
        self.engine_id = request.parent_id
        self.attempts = 0
        self.added = False
        self.sample = _PooledSample()

    async def run(self, deadline: Optional[float], timeout: Optional[float]) -> PooledOutput:
        failover_by: Optional[float] = None
        while True:
            try:
                await self._add()
            except EngineDeadError:
                if failover_by is None or time.monotonic() >= failover_by:
                    raise
                await asyncio.sleep(FAILOVER_POLL_S)  # no live engine yet: wait for one
                continue
            item = await self._outcome(deadline, timeout)
            if isinstance(item, PooledOutput):
                return item
            self._leave()  # its engine is gone: once more, elsewhere
            failover_by = failover_by or time.monotonic() + envs.GRIDSERVE_FAILOVER_TIMEOUT_S
            if time.monotonic() >= failover_by:
                raise item
            logger.warning("request %s: engine lost before its pooler output (%s); sending it again",
                           self.request.request_id, item)
            if self.service.metrics is not None and self.engine is not None:
                self.service.metrics.failover(self.service._engine_labels.get(id(self.engine), self.engine.address))

    async def _outcome(self, deadline: Optional[float], timeout: Optional[float]) -> Any:
        """The result, or the ``EngineDeadError`` of a lost engine."""
        while True:
            get = self.outputs.get()
            item = await (get if deadline is None else _by(deadline, get, timeout))
            if isinstance(item, EngineDeadError):
                return item
            if isinstance(item, Exception):
                raise item
            if isinstance(item, EngineCoreOutput) and item.finished:
                return self._result(item)

    def _result(self, item: EngineCoreOutput) -> PooledOutput:
        self.added = False  # finished: nothing to abort
        self.sample.finish_reason = item.finish_reason.value
        self.request.observation.on_sample_finished(item.finish_reason.value)
        if item.finish_reason is FinishReason.ERROR:
            raise RequestFailedError(f"request {self.request.request_id} failed: {item.error or 'unknown error'}")
        if item.pooler_output is None:
            raise RequestFailedError(f"request {self.request.request_id} ended ({item.finish_reason.value}) "
                                     "without a pooler output")
        return PooledOutput(self.request.request_id, list(item.pooler_output), len(self.prompt.token_ids))

    async def _add(self) -> None:
        """Add the engine request; an engine whose queue is full passes it to the next one."""
        refused: set[int] = set()
        while True:
            try:
                engine = self.service._pick_engine(self.rank, frozenset(refused))
            except EngineDeadError:
                if refused:
                    raise ResourceExhaustedError("every engine's queue is full") from None
                raise
            if self.attempts:  # a fresh id and queue: nothing of an earlier attempt reaches this one
                self.engine_id = f"{self.request.parent_id}-{self.attempts}"
                self.outputs = asyncio.Queue()
            self.attempts += 1
            engine.register(self.engine_id, self.outputs)
            try:
                await engine.add_request(self.engine_id, self.prompt.token_ids, None,
                                         parent_request_id=self.request.request_id,
                                         traceparent=self.request.observation.traceparent,
                                         pooling_params=self.params, token_type_ids=self.prompt.token_type_ids)
            except ResourceExhaustedError:
                engine.unregister(self.engine_id)
                if self.rank is not None:
                    raise
                refused.add(self.service.engines.index(engine))
                continue
            except (grpc.aio.AioRpcError, EngineDeadError) as exc:  # unreachable: as if lost (``run``)
                engine.unregister(self.engine_id)
                if isinstance(exc, grpc.aio.AioRpcError):
                    if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                                          grpc.StatusCode.CANCELLED):
                        raise
                    exc = EngineDeadError(f"engine {engine.address}: {exc.code().name}")
                self.engine = engine
                self.outputs.put_nowait(exc)
                return
            except BaseException:
                engine.unregister(self.engine_id)
                raise
            self.engine, self.added = engine, True
            if not self.request.observation.engine:
                self.request.observation.on_engine(self.service._engine_labels.get(id(engine), engine.address))
            return

    def _leave(self) -> None:
        """Stop listening on the current engine (aborting the request there if it still runs it)."""
        if self.engine is None:
            return
        self.engine.unregister(self.engine_id)
        if self.added:
            asyncio.run_coroutine_threadsafe(self.engine.abort([self.engine_id]), self.engine.loop)
            self.added = False

    def close(self) -> None:
        self._leave()


class _Stream:
    """One processed request on its way through the engines: fanned out into its ``n`` engine
    requests on the engine the router picks, each engine output turned into a ``StreamChunk``;
    a sample whose engine dies continues on another one (``fail_over``). Built on the loop without
    awaiting; ``close`` undoes everything it registers."""

    def __init__(self, request: _Request, processed: ProcessedPrompt, data_parallel_rank: Optional[int],
                 outputs: asyncio.Queue, lora_name: Optional[str] = None, priority: int = 0,
                 cache_salt: Optional[str] = None) -> None:
        service = request.service
        self.lora_name = lora_name
        self.priority = priority
        self.cache_salt = cache_salt
        self.service = service
        self.request_id, self.parent_id = request.request_id, request.parent_id
        self.observation = request.observation
        self.processed = processed
        self.outputs = outputs
        # Disaggregated prefill / decode: the prompt runs on the prefill pool first (``hand_off``).
        self.prefill = service.pools.prefill_first(processed.sampling_params, data_parallel_rank)
        self.pool = is_prefill if self.prefill else service.pools.continuation_pool()
        try:
            self.prefix_keys = service._prefix_keys(processed, lora_name, cache_salt)
            self.engine = service._pick_engine(data_parallel_rank, prefix_keys=self.prefix_keys, pool=self.pool)
        except Exception as exc:
            self.observation.end({}, 0, exc)
            raise
        _draw_seed(processed.sampling_params)
        self.engine_ids = child_requests(self.parent_id, processed.sampling_params)
        self.processor = OutputProcessor(service.tokenizer)
        self.processor.add_request(self.parent_id, processed, self.engine_ids)
        self.samples = self.processor.parents[self.parent_id].samples
        self.prompt_logprobs = self.processor.parents[self.parent_id].prompt_logprobs  # grows in place
        self.engine_of: dict[str, EngineClientProtocol] = {}  # each sample's engine now
        self.session_of: dict[str, int] = {}  # ... and its output stream then (older losses are stale)
        for child_id, _, _ in self.engine_ids:
            self._register(child_id, self.engine)
        self.sent = {child_id: _SentState() for child_id, _, _ in self.engine_ids}
        self.failovers = 0
        self.finished = False
        self.data_parallel_rank = data_parallel_rank
        self.timer: Optional[asyncio.TimerHandle] = None  # the deadline's
        self.refused = False  # every engine refused it: nothing to abort
        # P/D: the prefill engine of each sample handed off (it holds the prompt's KV until pulled)
        self.producer_of: dict[str, EngineClientProtocol] = {}
        service._enter()
        self.observation.on_engine(service._engine_labels.get(id(self.engine), self.engine.address))

    async def send(self) -> None:
        """Add the engine requests (on the engine client's loop, the server's). An engine whose
        queue is full refuses them: the next engine the router picks gets them, until none is left."""
        refused: set[int] = set()
        while True:
            try:
                return await self._add_all()
            except ResourceExhaustedError as exc:
                refused.add(self.service.engines.index(self.engine))
                if self.data_parallel_rank is not None:
                    raise  # pinned to this engine: nowhere else to go
                try:
                    engine = self.service._pick_engine(None, frozenset(refused), self.prefix_keys, self.pool)
                except EngineDeadError:
                    self.refused = True  # nothing of it is in any engine
                    raise ResourceExhaustedError(f"every engine's queue is full ({exc})",
                                                 exc.retry_after_s) from None
                self._move(engine)

    async def _add_all(self) -> None:
        added = []
        try:
            for child_id, _, child_params in self.engine_ids:
                engine = self.engine_of[child_id]
                try:
                    await self._add(engine, child_id, child_params, prefill_only=self.prefill)
                except EngineDeadError as exc:  # the engine died before it took the request
                    await self.fail_over(EngineLostError(str(exc), engine, child_id, engine.sessions))
                added.append(child_id)
        except ResourceExhaustedError:
            if added:  # n > 1: the samples it took are given back
                self.abort(added)
            raise

    def _move(self, engine: EngineClientProtocol) -> None:
        """Listen for the request's outputs on ``engine`` instead (its queue had room)."""
        for child_id in self.sent:
            self.engine_of[child_id].unregister(child_id)
            self._register(child_id, engine)
        self.engine = engine
        self.observation.on_engine(self.service._engine_labels.get(id(engine), engine.address))

    def _register(self, child_id: str, engine: EngineClientProtocol) -> None:
        engine.register(child_id, self.outputs)
        self.engine_of[child_id] = engine
        self.session_of[child_id] = engine.sessions

    async def _add(self, engine: EngineClientProtocol, child_id: str, params: SamplingParams,
                   output_token_ids: Optional[list[int]] = None, prefill_only: bool = False,
                   kv_transfer_params: Optional[KVTransferParams] = None) -> None:
        """Add one engine request; an unreachable engine raises ``EngineDeadError``. ``prefill_only``
        (a prefill engine) / ``kv_transfer_params`` (a decode engine): disaggregated serving."""
        continued = {} if output_token_ids is None else {"output_token_ids": output_token_ids, "continuation": True}
        if prefill_only:  # only then: an in-process engine client knows no KV roles
            continued["prefill_only"] = True
        if kv_transfer_params is not None:
            continued["kv_transfer_params"] = kv_transfer_params
        if self.lora_name is not None:  # only then: an engine client without LoRA serves the base model
            continued["lora_name"] = self.lora_name
        if self.priority:  # likewise: 0 is every engine's default
            continued["priority"] = self.priority
        if self.cache_salt is not None:
            continued["cache_salt"] = self.cache_salt
        try:
            await engine.add_request(child_id, self.processed.prompt_token_ids, params,
                                     parent_request_id=self.request_id,
                                     traceparent=self.observation.traceparent,
                                     mm_features=self.processed.mm_features, **continued)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND and self.lora_name is not None:
                # The adapter was unloaded since the gateway's copy of the table said it exists.
                self.service.loras.invalidate()
                raise not_found(self.lora_name) from None
            if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                                  grpc.StatusCode.CANCELLED):
                raise
            raise EngineDeadError(f"engine {engine.address}: {exc.code().name}") from None

    async def fail_over(self, lost: EngineLostError) -> None:
        """Continue the sample ``lost`` names on a live engine, from the tokens the gateway has.

        Stale news (the sample already moved or finished) is ignored; without a live engine within
        ``GRIDSERVE_FAILOVER_TIMEOUT_S`` the request fails with ``lost``."""
        child_id = lost.request_id
        sample = self.samples.get(child_id)
        if (self.engine_of.get(child_id) is not lost.engine or lost.session < self.session_of[child_id]
                or sample is None or sample.finish_reason is not None):
            return
        lost.engine.unregister(child_id)
        params = self._continuation_params(child_id)
        deadline = time.monotonic() + envs.GRIDSERVE_FAILOVER_TIMEOUT_S
        while True:
            engine = await self._live_engine(deadline, lost)
            # In case only the stream broke and the engine still runs the sample: abort it there
            # (first, when the sample goes back to that same engine).
            if engine is lost.engine:
                await engine.abort([child_id])
            else:
                self.abort([child_id], lost.engine)
            self._register(child_id, engine)
            try:
                await self._add(engine, child_id, params, list(sample.token_ids))
            except EngineDeadError as exc:
                engine.unregister(child_id)
                logger.info("request %s: failover to %s failed (%s); trying again", self.request_id,
                            engine.address, exc)
                await asyncio.sleep(FAILOVER_POLL_S)
                continue
            self.failovers += 1
            if self.service.metrics is not None:
                self.service.metrics.failover(self.service._engine_labels.get(id(lost.engine), lost.engine.address))
            logger.warning("request %s: sample %d continues on engine %s after %d tokens (%s)",
                           self.request_id, sample.index, engine.address, len(sample.token_ids), lost)
            return

    async def hand_off(self, prefilled: EngineCoreOutput) -> StreamChunk:
        """A prefill engine's final output of a prefilled request: its first token goes to the
        caller as a token of a request that goes on, and the request to a decode engine that pulls
        the prompt's KV (``prefilled.kv_transfer_params``) and decodes the rest. Without a decode
        engine up, or when the chosen one is lost, the failover continues it whole (no KV: the
        prompt is computed there; on any engine when no decode engine is reachable)."""
        child_id = prefilled.request_id
        producer, session = self.engine_of[child_id], self.session_of[child_id]
        chunk = self.on_item(first_token(prefilled))
        sample = self.samples.get(child_id)
        if sample is None or sample.finish_reason is not None:  # a stop string ended it at once
            return chunk
        try:
            engine = self.service._pick_engine(prefix_keys=self.prefix_keys,
                                               pool=self.service.pools.decode_pool_for(producer))
        except EngineDeadError as exc:
            # none up, or none whose KV layout pairs with the producer's: continued whole (the
            # failover aborts it on the producer, which frees the held blocks at once)
            await self.fail_over(EngineLostError(f"no decode engine for the hand-off: {exc}", producer, child_id,
                                                 session))
            return chunk
        producer.unregister(child_id)
        self._register(child_id, engine)
        self.producer_of[child_id] = producer
        try:
            await self._add(engine, child_id, self._continuation_params(child_id), list(sample.token_ids),
                            kv_transfer_params=prefilled.kv_transfer_params)
        except EngineDeadError as exc:
            # nobody pulls: the prefill engine frees the blocks now (awaited: the failover may add
            # the sample there again, and that one must not be aborted)
            await producer.abort([child_id])
            await self.fail_over(EngineLostError(str(exc), engine, child_id, self.session_of[child_id]))
        return chunk

    def _continuation_params(self, child_id: str) -> SamplingParams:
        """The sample's parameters; prompt logprobs the gateway already has are not asked again."""
        params = next(p for cid, _, p in self.engine_ids if cid == child_id)
        parent = self.processor.parents.get(self.parent_id)
        if params.prompt_logprobs is None or parent is None or parent.prompt_logprobs is None:
            return params
        if len(parent.prompt_logprobs) >= len(self.processed.prompt_token_ids):
            return replace(params, prompt_logprobs=None)
        parent.prompt_logprobs[1:] = []  # a prefill cut short: the continuation reports them all
        return params

    async def _live_engine(self, deadline: float, lost: EngineLostError) -> EngineClientProtocol:
        while True:
            try:
                return self.service._pick_engine(pool=self.service.pools.continuation_pool())
            except EngineDeadError:
                if time.monotonic() >= deadline:
                    raise lost from None
                await asyncio.sleep(FAILOVER_POLL_S)

    def abort(self, request_ids: list[str], engine: Optional[EngineClientProtocol] = None) -> None:
        """Abort engine requests without waiting (from the loop or any thread), each on its engine
        (or all on ``engine``)."""
        by_engine: dict[int, tuple[EngineClientProtocol, list[str]]] = {}
        for request_id in request_ids:
            target = engine or self.engine_of.get(request_id, self.engine)
            by_engine.setdefault(id(target), (target, []))[1].append(request_id)
        for target, ids in by_engine.values():
            asyncio.run_coroutine_threadsafe(target.abort(ids), target.loop)

    def on_item(self, item: Any) -> StreamChunk:
        """The chunk one engine output adds (an exception from the engine client is raised)."""
        if isinstance(item, Exception):
            raise item
        if item.finish_reason is FinishReason.ERROR:  # this request failed in the engine; others go on
            sample = self.samples.get(item.request_id)
            if sample is not None:
                sample.finish_reason = FinishReason.ERROR.value
            self.observation.on_sample_finished(FinishReason.ERROR.value)
            raise RequestFailedError(f"request {self.request_id} failed: {item.error or 'unknown error'}")
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
                           len(self.processed.prompt_token_ids), done[0] if done else None, self.prompt_logprobs,
                           self.processed.prompt_token_ids)

    def close(self, error: Optional[BaseException]) -> None:
        """Stop listening; abort the engine requests if the request did not finish."""
        if self.timer is not None:
            self.timer.cancel()
        for child_id, engine in self.engine_of.items():
            engine.unregister(child_id)
        if not self.finished and not self.refused:
            self.abort(list(self.sent))
            # P/D: a decode engine that drops the request before its pull leaves the prefill engine
            # holding the prompt's KV; the abort releases it there now, not at the deadline.
            for child_id, producer in self.producer_of.items():
                self.abort([child_id], producer)
        self.service._exit()
        self.observation.end(self.samples, len(self.processed.prompt_token_ids), error)


def _expired(timeout: float) -> DeadlineExceededError:
    return DeadlineExceededError(f"the request did not finish within its deadline ({timeout:.3g} s)")


async def _by(deadline: float, awaitable: Any, timeout: float) -> Any:
    """``awaitable``'s result if it comes before ``deadline`` (the loop's clock)."""
    try:
        return await asyncio.wait_for(awaitable, deadline - asyncio.get_running_loop().time())
    except asyncio.TimeoutError:
        raise _expired(timeout) from None


def _draw_seed(params: SamplingParams) -> None:
    """Give an unseeded sampled request a seed (recorded in its params) so that a continuation on
    another engine samples the same stream; greedy requests need none."""
    if params.seed is None and not params.greedy:
        params.seed = secrets.randbits(63)


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


async def gather_or_cancel(requests: Iterable[Awaitable[Any]]) -> list[Any]:
    """Run one request's engine calls together; when one fails, the others are cancelled (and aborted)."""
    tasks = [asyncio.ensure_future(r) for r in requests]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        raise
