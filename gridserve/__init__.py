"""gridserve: a vLLM-style inference server split into gRPC services.

Offline use::

    from gridserve import LLM, SamplingParams
    llm = LLM(model="path/to/hf-folder")
    print(llm.generate(["Hello"], SamplingParams(max_tokens=8))[0].outputs[0].text)
"""

from __future__ import annotations

# The top-level folders services/, shared/, kernels/, demo/ and benchmarks/ are the subpackages
# gridserve.services, gridserve.shared, ... through one mechanism: the build's package-dir mapping
# (setup.py ROOTS; an editable install's finder or a wheel). Install first: `make install`.
from gridserve.shared.lora import LoRARequest
from gridserve.shared.model_registry import ModelRegistry
from gridserve.shared.outputs import CompletionOutput, RequestOutput
from gridserve.shared.sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "AsyncLLM", "LoRARequest", "ModelRegistry", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput",
           "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence", "__version__"]


def __getattr__(name: str):
    # LLM pulls in the worker (torch), beam search the gateway: import them only when asked for.
    if name == "LLM":
        from gridserve.llm import LLM

        return LLM
    if name in ("BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence"):  # vLLM's names, served here
        from gridserve.services.gateway import beam_search

        return getattr(beam_search, name)
    if name == "AsyncLLM":
        from gridserve.async_llm import AsyncLLM

        return AsyncLLM
    raise AttributeError(f"module 'gridserve' has no attribute {name!r}")
