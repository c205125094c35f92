"""gridserve: a vLLM-style inference server split into gRPC services.

Offline use::

    from gridserve import LLM, SamplingParams
    llm = LLM(model="path/to/hf-folder")
    print(llm.generate(["Hello"], SamplingParams(max_tokens=8))[0].outputs[0].text)
"""

from __future__ import annotations

from pathlib import Path as _Path

# Running from a source checkout without installing: the roles live in top-level folders beside
# this package (services/, shared/, kernels/); make them importable as gridserve.<folder>.
_checkout = _Path(__file__).resolve().parent.parent
if (_checkout / "setup.py").is_file() and (_checkout / "services").is_dir():
    __path__.append(str(_checkout))  # type: ignore[name-defined]  # noqa: F821

from gridserve.shared.model_registry import ModelRegistry  # noqa: E402
from gridserve.shared.outputs import CompletionOutput, RequestOutput  # noqa: E402
from gridserve.shared.sampling_params import SamplingParams, StructuredOutputsParams  # noqa: E402

__version__ = "0.1.0"
__all__ = ["LLM", "AsyncLLM", "ModelRegistry", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput",
           "__version__"]


def __getattr__(name: str):
    # LLM pulls in the worker (torch); import it only when asked for.
    if name == "LLM":
        from gridserve.llm import LLM

        return LLM
    if name == "AsyncLLM":
        from gridserve.async_llm import AsyncLLM

        return AsyncLLM
    raise AttributeError(f"module 'gridserve' has no attribute {name!r}")
