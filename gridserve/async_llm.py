"""``AsyncLLM``: vLLM's async engine API: ``async for out in engine.generate(prompt, params, request_id)``.

The engine core runs in this process (``AsyncLLM(model=..., **engine_kwargs)``: its busy loop in a
thread, as ``LLM``) or in remote engines (``AsyncLLM(engine_addresses=[...])``), reached through the
gateway's own ``EngineClient`` over the engine's gRPC contract. Either way this class does what the
gateway does: validate and tokenize, fan out ``n``, pick the engine with the fewest requests in
flight, detokenize and apply stop strings, and abort what the caller abandons.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any, Optional, Union

from gridserve.services.gateway.multimodal import MultiModalProcessor
from gridserve.services.gateway.processor import (
    InputProcessor,
    OutputProcessor,
    PromptType,
    child_requests,
)
from gridserve.shared.config import GridserveConfig
from gridserve.shared.engine_client_protocol import EngineClientProtocol
from gridserve.shared.errors import ConfigError, EngineDeadError, InvalidArgumentError
from gridserve.shared.outputs import RequestOutput
from gridserve.shared.request_checks import check_cache_salt
from gridserve.shared.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 60.0


class AsyncLLM:
    """An async engine: in process (``model`` and vLLM's engine keywords, as ``LLM``) or remote
    (``engine_addresses``: engine services, host:port; ``tokenizer`` or ``model``: a local copy of
    the model's tokenizer when the engines' path is not readable here).

    The engines start (or connect) on the event loop of the first ``generate``; ``await close()``
    stops them.
    """

    def __init__(self, model: Optional[str] = None, *, engine_addresses: Optional[list[str]] = None,
                 **engine_kwargs: Any) -> None:
        if engine_addresses and set(engine_kwargs) - {"tokenizer"}:
            raise ConfigError("engine_addresses", "remote engines take no engine options, only tokenizer: "
                              f"got {sorted(set(engine_kwargs) - {'tokenizer'})}")
        if not engine_addresses and not model:
            raise ConfigError("model", "give a model (in-process engine) or engine_addresses (remote engines)")
        self.engine_addresses = list(engine_addresses or [])
        # remote: the tokenizer from here, else the model's folder as the engines name it
        self.tokenizer_override = (engine_kwargs.pop("tokenizer", None) or model) if self.engine_addresses else None
        self.config: Optional[GridserveConfig] = None
        if not self.engine_addresses:
            self.config = GridserveConfig.from_kwargs(model=model, **engine_kwargs).finalize()
        self.engines: list[EngineClientProtocol] = []
        self.tokenizer: Any = None
        self._launchers: list[Any] = []
        self._start_lock: Optional[asyncio.Lock] = None
        self._requests: dict[str, tuple[EngineClientProtocol, list[str]]] = {}  # id -> (engine, engine ids)

    @classmethod
    def from_engine_args(cls, engine_args: Union[Mapping[str, Any], Any]) -> AsyncLLM:
        """vLLM's constructor from engine arguments: a mapping or an object of them (a dataclass)."""
        if dataclasses.is_dataclass(engine_args):
            engine_args = dataclasses.asdict(engine_args)
        elif not isinstance(engine_args, Mapping):
            engine_args = vars(engine_args)
        return cls(**{k: v for k, v in engine_args.items() if v is not None})

    # ---- the API ------------------------------------------------------------------------------------
    async def generate(self, prompt: PromptType, sampling_params: Optional[SamplingParams] = None,
                       request_id: Optional[str] = None, priority: int = 0,
                       cache_salt: Optional[str] = None) -> AsyncIterator[RequestOutput]:
        """The request's output after every step that added tokens (cumulative), the last one
        ``finished``. Leaving the loop early (or cancelling) aborts the request. ``priority``: lower
        runs first, on an engine with ``--scheduling-policy priority`` (any other refuses all but 0).
        ``cache_salt``: only requests with the same salt share prefix-cache blocks."""
        await self._start()
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._requests:
            raise InvalidArgumentError("request_id", f"{request_id!r} is already running")
        if cache_salt is not None:
            check_cache_salt(cache_salt)
        processed = self.input_processor.process(prompt, sampling_params or SamplingParams())
        children = child_requests(request_id, processed.sampling_params)
        engine = min(self.engines, key=lambda e: e.num_in_flight)
        outputs: asyncio.Queue = asyncio.Queue()
        child_ids = [child_id for child_id, _, _ in children]
        self.output_processor.add_request(request_id, processed, children)
        self._requests[request_id] = (engine, child_ids)
        for child_id in child_ids:
            engine.register(child_id, outputs)
        finished = False
        try:
            for child_id, _, params in children:
                await engine.add_request(child_id, processed.prompt_token_ids, params, parent_request_id=request_id,
                                         mm_features=processed.mm_features, priority=priority,
                                         cache_salt=cache_salt)
            while not finished:
                item = await outputs.get()
                if isinstance(item, Exception):
                    raise item
                done, to_abort = self.output_processor.process_outputs([item])
                if to_abort:
                    await engine.abort(to_abort)
                if done:
                    finished = True
                    yield done[0]
                elif item.new_token_ids:
                    yield self.output_processor.current(request_id)
        finally:
            for child_id in child_ids:
                engine.unregister(child_id)
            self._requests.pop(request_id, None)
            if not finished:
                self.output_processor.abort(request_id)
                await _quietly(engine.abort(child_ids))

    async def abort(self, request_id: Union[str, list[str]]) -> None:
        """Abort requests: their ``generate`` ends with a last output, finish reason ``abort``, and
        their KV blocks are freed. Unknown or finished ids are ignored."""
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            entry = self._requests.get(rid)
            if entry is not None:
                engine, child_ids = entry
                await engine.abort(child_ids)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    async def close(self) -> None:
        """Disconnect from remote engines, or stop the in-process engine and its workers."""
        engines, self.engines = self.engines, []
        for engine in engines:
            await engine.close()
        for launcher in self._launchers:
            launcher.stop()
        self._launchers = []

    # ---- start-up -----------------------------------------------------------------------------------
    async def _start(self) -> None:
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
        async with self._start_lock:
            if self.engines:
                return
            if self.engine_addresses:
                await self._connect()
            else:
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(None, self._start_local, loop)

    def _start_local(self, loop: asyncio.AbstractEventLoop) -> None:
        """Load the model into in-process engines (with TP / PP / DP: local worker processes, as
        ``LLM``); runs in a thread, the engines' outputs go to ``loop``."""
        from gridserve.llm import _start_local_workers
        from gridserve.local_engine_client import LocalEngineClient

        self.tokenizer = _load_tokenizer(self.config.model.tokenizer_path)
        engines = []
        try:
            for _ in range(self.config.parallel.data_parallel_size):
                config = copy.deepcopy(self.config)
                launcher = _start_local_workers(config, self.config.parallel.data_parallel_size)
                if launcher is not None:
                    self._launchers.append(launcher)
                engines.append(LocalEngineClient(config, loop))
        except BaseException:
            for engine in engines:
                engine.shutdown()  # this thread is not the event loop's: close() would need it
            for launcher in self._launchers:
                launcher.stop()
            self._launchers = []
            raise
        self._processors(self.config.max_model_len, self.config.model.vocab_size, self.config.model.max_logprobs,
                         self.config.model.model_path)
        self.engines = engines

    async def _connect(self) -> None:
        from gridserve.shared.rpc.engine_client import EngineClient

        gateway_id = f"async-llm-{uuid.uuid4().hex[:8]}"
        engines = [EngineClient(address, gateway_id) for address in self.engine_addresses]
        try:
            info = await engines[0].info(timeout=CONNECT_TIMEOUT_S)
            loop = asyncio.get_running_loop()
            for engine in engines:
                ready = await loop.run_in_executor(None, engine.ready.wait, CONNECT_TIMEOUT_S)
                if not ready:
                    raise EngineDeadError(f"engine {engine.address} did not open its output stream")
        except BaseException:
            for engine in engines:
                await engine.close()
            raise
        self.tokenizer = await loop.run_in_executor(None, _load_tokenizer, self.tokenizer_override or info.tokenizer_path)
        self._processors(info.max_model_len, info.vocab_size, info.max_logprobs,
                         self.tokenizer_override or info.model_path)
        self.engines = engines

    def _processors(self, max_model_len: int, vocab_size: int, max_logprobs: int, model_path: str) -> None:
        """The gateway's processors; ``model_path``: where the image processor's config is (if any)."""
        multimodal = MultiModalProcessor.from_model_folder(model_path)
        self.input_processor = InputProcessor(self.tokenizer, max_model_len, vocab_size, max_logprobs, multimodal)
        self.output_processor = OutputProcessor(self.tokenizer)


async def _quietly(coroutine: Any) -> None:
    try:
        await coroutine
    except Exception as exc:  # noqa: BLE001 - best effort: the engine may be gone
        logger.info("abort failed: %s", exc)


def _load_tokenizer(path: str) -> Any:
    """A tokenizer folder or hub id (AutoTokenizer), or the tokenizer embedded in a ``.gguf`` file."""
    from gridserve.services.worker.gguf_loader import load_hf_tokenizer

    return load_hf_tokenizer(path)
