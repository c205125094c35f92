"""``LLMEngine``: the gateway's request processing and an in-process ``EngineCore``, in one object.

This is the offline stack under ``LLM``: tokenize and validate -> engine core steps -> detokenize,
stop strings -> ``RequestOutput``. It assembles two roles, so it lives outside ``services/``.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, Optional

from gridserve.services.engine.core import EngineCore
from gridserve.services.engine.executor import Executor
from gridserve.services.engine.request import Request
from gridserve.services.engine.request_checks import check_prompt_ids
from gridserve.services.gateway.multimodal import MultiModalProcessor
from gridserve.services.gateway.processor import (
    InputProcessor,
    OutputProcessor,
    PromptType,
    child_requests,
)
from gridserve.shared.config import GridserveConfig
from gridserve.shared.errors import InvalidArgumentError, RequestFailedError
from gridserve.shared.lora import LoRARequest
from gridserve.shared.outputs import RequestOutput
from gridserve.shared.pooling import PoolingParams
from gridserve.shared.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def in_process_executor(config: GridserveConfig) -> Optional[Executor]:
    """The ``uni`` backend with the worker role's ``Worker`` (imported here: this module assembles
    both roles, with the worker extension mixed in); None for other backends, which ``EngineCore`` builds itself."""
    if config.parallel.executor_backend != "uni":
        return None
    from gridserve.services.engine.executor.uniproc import UniProcExecutor
    from gridserve.services.worker.extension import worker_class

    return UniProcExecutor(config, lambda c: worker_class(c)(c))


class LLMEngine:
    """Adds requests, steps the engine core, and returns finished ``RequestOutput``s."""

    def __init__(self, config: GridserveConfig, tokenizer: Any) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.core = EngineCore(config, in_process_executor(config))
        self.input_processor = InputProcessor(
            tokenizer, config.max_model_len, config.model.vocab_size, config.model.max_logprobs,
            MultiModalProcessor.from_model_folder(config.model.model_path),
        )
        self.output_processor = OutputProcessor(tokenizer)
        self._ids = itertools.count()
        self._pooling: dict[str, list[int]] = {}  # pooling requests in flight -> their prompt

    def add_request(self, prompt: PromptType, params: SamplingParams, request_id: Optional[str] = None,
                    lora_request: Optional[LoRARequest] = None, priority: int = 0) -> str:
        """Validate and tokenize, then queue one engine request per sample (``n``), on the base model
        or on ``lora_request``'s adapter (loaded on the workers the first time it is named), with
        ``priority`` (lower runs first; only with ``scheduling_policy="priority"``)."""
        request_id = request_id if request_id is not None else str(next(self._ids))
        if lora_request is not None:
            if not isinstance(lora_request, LoRARequest):
                raise InvalidArgumentError("lora_request", f"must be a LoRARequest, got {type(lora_request).__name__}")
            if self.core.lora is None:
                raise InvalidArgumentError("lora_request", "LoRA is off: build the LLM with enable_lora=True")
            lora_request = self.core.lora.register(lora_request)
        processed = self.input_processor.process(prompt, params)
        children = child_requests(request_id, processed.sampling_params)
        self.output_processor.add_request(request_id, processed, children)
        for child_id, _, child_params in children:
            self.core.add_request(
                Request(
                    child_id,
                    processed.prompt_token_ids,
                    child_params,
                    eos_token_id=self.config.model.eos_token_id,
                    mm_features=processed.mm_features,
                    lora_request=lora_request,
                    priority=priority,
                )
            )
        return request_id

    def add_pooling_request(self, token_ids: list[int], params: PoolingParams,
                            token_type_ids: Optional[list[int]] = None, request_id: Optional[str] = None) -> str:
        """Queue one pooling request (a pooling model): its embedding or scores come back from ``step``
        as the raw values (``EngineCoreOutput.pooler_output``)."""
        request_id = request_id if request_id is not None else str(next(self._ids))
        check_prompt_ids(self.config, token_ids)
        self.core.add_request(Request(request_id, token_ids, SamplingParams(max_tokens=1),
                                      pooling_params=params, token_type_ids=token_type_ids))
        self._pooling[request_id] = token_ids
        return request_id

    def abort_request(self, request_ids: list[str]) -> list[RequestOutput]:
        outputs = []
        for request_id in request_ids:
            if self._pooling.pop(request_id, None) is not None:
                self.core.abort_requests([request_id])
                continue
            self.core.abort_requests(self.output_processor.children_of(request_id))
            out = self.output_processor.abort(request_id)
            if out is not None:
                outputs.append(out)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """One engine step; returns the requests that finished in it."""
        outputs = self.core.step()
        pooled = [o for o in outputs if o.request_id in self._pooling]
        if pooled:
            outputs = [o for o in outputs if o.request_id not in self._pooling]
        finished, to_abort = self.output_processor.process_outputs(outputs)
        if to_abort:
            self.core.abort_requests(to_abort)
        for out in pooled:
            if out.finished:
                self._pooling.pop(out.request_id)
                if out.pooler_output is None:
                    raise RequestFailedError(f"pooling request {out.request_id} failed: {out.error}")
                finished.append(out)
        return finished

    def shutdown(self) -> None:
        self.core.shutdown()
