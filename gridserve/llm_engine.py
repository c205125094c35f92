"""``LLMEngine``: the gateway's request processing and an in-process ``EngineCore``, in one object.

This is the offline stack under ``LLM``: tokenize and validate -> engine core steps -> detokenize,
stop strings -> ``RequestOutput``. It assembles two roles, so it lives outside ``services/``.
"""

from __future__ import annotations

import itertools
import logging
from typing import Any, Optional

from gridserve.services.engine.core import EngineCore
from gridserve.services.engine.request import Request
from gridserve.services.gateway.processor import InputProcessor, OutputProcessor, PromptType
from gridserve.shared.config import GridserveConfig
from gridserve.shared.outputs import RequestOutput
from gridserve.shared.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    """Adds requests, steps the engine core, and returns finished ``RequestOutput``s."""

    def __init__(self, config: GridserveConfig, tokenizer: Any) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.core = EngineCore(config)
        self.input_processor = InputProcessor(tokenizer, config.max_model_len, config.model.vocab_size)
        self.output_processor = OutputProcessor(tokenizer)
        self._ids = itertools.count()

    def add_request(self, prompt: PromptType, params: SamplingParams, request_id: Optional[str] = None) -> str:
        request_id = request_id if request_id is not None else str(next(self._ids))
        processed = self.input_processor.process(prompt, params)
        request = Request(
            request_id,
            processed.prompt_token_ids,
            processed.sampling_params,
            eos_token_id=self.config.model.eos_token_id,
        )
        self.output_processor.add_request(request_id, processed)
        self.core.add_request(request)
        return request_id

    def abort_request(self, request_ids: list[str]) -> list[RequestOutput]:
        self.core.abort_requests(request_ids)
        return [out for rid in request_ids if (out := self.output_processor.abort(rid)) is not None]

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        """One engine step; returns the requests that finished in it."""
        finished, to_abort = self.output_processor.process_outputs(self.core.step())
        if to_abort:
            self.core.abort_requests(to_abort)
        return finished

    def shutdown(self) -> None:
        self.core.shutdown()
