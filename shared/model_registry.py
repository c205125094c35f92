"""``ModelRegistry``: which architectures a worker can build, and where an out-of-tree one lives.

The checkpoint's ``config.json`` names its architecture (``LlamaForCausalLM``); the worker builds
the class registered under that name. Built-in architectures live in the worker role
(``services/worker/models``); plugins add theirs with ``register_model`` as a lazy ``"module:Class"``
string, so every process can register and check a model (the gateway and the engine too, which
never import torch) while only the worker imports it. A class object may be registered as well, in
a process that runs the worker itself (offline ``LLM``).
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass
from typing import Optional, Union

from gridserve.shared.errors import ConfigError, InvalidArgumentError

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class ArchitectureInfo:
    """What a built-in architecture is and what it supports, known without importing torch.

    ``module`` is ``"module:Class"`` under ``gridserve.services.worker.models``; ``examples`` are
    Hugging Face checkpoints of that architecture (the docs' supported-models table); ``kv_kind``
    is what each attention layer caches (``full``: K and V of every token; ``sliding``: some or
    all layers see only a window when the config sets one (``sliding_window``; Qwen2 / Qwen3 /
    SmolLM3 only with ``use_sliding_window``), their KV still kept whole until the cache has a
    per-layer spec; ``mla``: a compressed latent; ``none``: an encoder, which keeps no KV).

    ``runner`` is what serves it (vLLM's names): ``generate`` (a language model: text out) or
    ``pooling`` (an encoder: vectors or scores out, never tokens); ``tasks`` are what it serves
    (``generate``; ``embed`` / ``classify`` / ``score``: ``gridserve.shared.pooling``). A generative
    decoder serves ``embed`` too when converted (``resolve_runner``).
    """

    name: str
    module: str
    examples: tuple[str, ...] = ()
    tensor_parallel: bool = True
    pipeline_parallel: bool = True
    quantization: bool = True
    multimodal: bool = False
    kv_kind: str = "full"
    runner: str = "generate"
    tasks: tuple[str, ...] = ("generate",)


def _arch(name: str, module: str, *examples: str, **features) -> ArchitectureInfo:
    return ArchitectureInfo(name, module, tuple(examples), **features)


def _pooling(name: str, module: str, tasks: tuple[str, ...], *examples: str) -> ArchitectureInfo:
    """A pooling-only architecture (issue 37: an encoder, or a decoder that is an embedder by name):
    whole inputs, no KV cache, pooled outputs. Tensor parallel; no pipeline stages (a model this
    size never needs them) and no quantization (untested)."""
    return ArchitectureInfo(name, module, tuple(examples), pipeline_parallel=False, quantization=False,
                            kv_kind="none", runner="pooling", tasks=tasks)


# The worker role's own models, one entry per Hugging Face class name (``config.json``'s
# ``architectures``); ``services/worker/models/__init__.py`` imports ``module`` when one is built.
ARCHITECTURES: dict[str, ArchitectureInfo] = {a.name: a for a in (
    _arch("LlamaForCausalLM", "llama:LlamaForCausalLM", "meta-llama/Llama-3.2-1B-Instruct",
          "HuggingFaceTB/SmolLM2-135M-Instruct"),
    _arch("MistralForCausalLM", "llama:MistralForCausalLM", "mistralai/Mistral-7B-Instruct-v0.3",
          kv_kind="sliding"),
    _arch("MixtralForCausalLM", "mixtral:MixtralForCausalLM", "mistralai/Mixtral-8x7B-Instruct-v0.1",
          kv_kind="sliding"),
    _arch("Qwen2ForCausalLM", "llama:Qwen2ForCausalLM", "Qwen/Qwen2.5-0.5B-Instruct", kv_kind="sliding"),
    # mixture of experts (issue 32): ``--quantization`` quantizes the routed experts too (each expert's
    # matrices as a dense layer's, ``FusedMoE.quantize``); the routers stay float
    _arch("Qwen2MoeForCausalLM", "qwen_moe:Qwen2MoeForCausalLM", "Qwen/Qwen1.5-MoE-A2.7B", kv_kind="sliding"),
    _arch("Qwen3MoeForCausalLM", "qwen_moe:Qwen3MoeForCausalLM", "Qwen/Qwen3-30B-A3B", kv_kind="sliding"),
    # multi-head latent attention (issue 32): the cache holds one latent per token
    _arch("DeepseekV2ForCausalLM", "deepseek:DeepseekV2ForCausalLM", "deepseek-ai/DeepSeek-V2-Lite-Chat",
          kv_kind="mla"),
    _arch("DeepseekV3ForCausalLM", "deepseek:DeepseekV3ForCausalLM", "deepseek-ai/DeepSeek-V3",
          kv_kind="mla"),
    _arch("OPTForCausalLM", "opt:OPTForCausalLM", "facebook/opt-125m", pipeline_parallel=False),
    # the dense zoo (issue 30): each helper-owned entry's features are set by the model's author
    _arch("Qwen3ForCausalLM", "qwen3:Qwen3ForCausalLM", "Qwen/Qwen3-0.6B", kv_kind="sliding"),
    _arch("SmolLM3ForCausalLM", "smollm3:SmolLM3ForCausalLM", "HuggingFaceTB/SmolLM3-3B", kv_kind="sliding"),
    _arch("Olmo2ForCausalLM", "olmo2:Olmo2ForCausalLM", "allenai/OLMo-2-0425-1B-Instruct"),
    _arch("GraniteForCausalLM", "granite:GraniteForCausalLM", "ibm-granite/granite-3.3-2b-instruct"),
    _arch("Phi3ForCausalLM", "phi3:Phi3ForCausalLM", "microsoft/Phi-3-mini-4k-instruct", kv_kind="sliding"),
    _arch("Glm4ForCausalLM", "glm4:Glm4ForCausalLM", "THUDM/GLM-4-9B-0414"),
    _arch("CohereForCausalLM", "cohere:CohereForCausalLM", "CohereForAI/c4ai-command-r-v01"),
    _arch("GemmaForCausalLM", "gemma:GemmaForCausalLM", "google/gemma-2b-it"),
    _arch("Gemma2ForCausalLM", "gemma:Gemma2ForCausalLM", "google/gemma-2-2b-it", kv_kind="sliding"),
    _arch("Gemma3ForCausalLM", "gemma:Gemma3ForCausalLM", "google/gemma-3-1b-it", kv_kind="sliding"),
    _arch("StableLmForCausalLM", "stablelm:StableLmForCausalLM", "stabilityai/stablelm-2-1_6b-chat"),
    _arch("Starcoder2ForCausalLM", "starcoder2:Starcoder2ForCausalLM", "bigcode/starcoder2-3b",
          kv_kind="sliding"),
    _arch("GPT2LMHeadModel", "gpt2:GPT2LMHeadModel", "openai-community/gpt2"),
    _arch("GPTJForCausalLM", "gptj:GPTJForCausalLM", "EleutherAI/gpt-j-6b"),
    _arch("GPTNeoXForCausalLM", "gpt_neox:GPTNeoXForCausalLM", "EleutherAI/pythia-160m"),
    _arch("PhiForCausalLM", "phi:PhiForCausalLM", "microsoft/phi-2"),
    _arch("FalconForCausalLM", "falcon:FalconForCausalLM", "tiiuae/falcon-7b-instruct"),
    _arch("BloomForCausalLM", "bloom:BloomForCausalLM", "bigscience/bloomz-560m"),
    # attention sinks, window / full layers, a biased MoE (issue 32); bf16 checkpoints only (no MXFP4)
    _arch("GptOssForCausalLM", "gpt_oss:GptOssForCausalLM", "openai/gpt-oss-20b", kv_kind="sliding"),
    _arch("LlavaForConditionalGeneration", "llava:LlavaForConditionalGeneration", "llava-hf/llava-1.5-7b-hf",
          pipeline_parallel=False, multimodal=True),
    # encoders (issue 37): pooling only, the engine never generates with them; a classifier serves
    # ``score`` only with one label (a cross-encoder: the worker's model says which it has)
    _pooling("BertModel", "bert:BertModel", ("embed",), "BAAI/bge-base-en-v1.5",
             "sentence-transformers/all-MiniLM-L6-v2"),
    _pooling("BertForSequenceClassification", "bert:BertForSequenceClassification", ("classify", "score"),
             "cross-encoder/ms-marco-MiniLM-L-6-v2"),
    _pooling("XLMRobertaModel", "bert:XLMRobertaModel", ("embed",), "BAAI/bge-m3",
             "intfloat/multilingual-e5-base"),
    _pooling("XLMRobertaForSequenceClassification", "bert:XLMRobertaForSequenceClassification",
             ("classify", "score"), "BAAI/bge-reranker-v2-m3"),
    # a decoder that is an embedder by name (EmbeddingGemma's config.json): the bare Gemma 3 text
    # model, bidirectional when its config says so, served by the pooling runner without --convert
    _pooling("Gemma3TextModel", "gemma:Gemma3TextModel", ("embed",), "google/embeddinggemma-300m"),
)}

# Every built-in architecture name.
BUILTIN_ARCHITECTURES = tuple(sorted(ARCHITECTURES))


def architecture_info(architecture: str) -> Optional[ArchitectureInfo]:
    """The built-in architecture's metadata (None for a plugin's or an unknown one)."""
    return ARCHITECTURES.get(architecture)


GENERATE, POOLING = "generate", "pooling"
RUNNERS = (GENERATE, POOLING)
# ``convert``: what a generative checkpoint becomes under the pooling runner (vLLM's ``--convert``)
CONVERTS = ("none", "embed")


@dataclass(frozen=True)
class RunnerChoice:
    """The runner a model is served by, the conversion applied to it and the tasks it then serves."""

    runner: str
    convert: str
    tasks: tuple[str, ...]


def is_pooling_only(architecture: str) -> bool:
    """True for an encoder that never generates (the engine refuses a generate request to it)."""
    info = architecture_info(architecture)
    return info is not None and info.runner == POOLING


def resolve_runner(architecture: str, runner: str = "auto", convert: str = "auto") -> RunnerChoice:
    """What serves ``architecture`` (vLLM's ``--runner`` / ``--convert``), refused naming the field.

    ``runner="auto"``: the architecture's own (``pooling`` for an encoder, else ``generate``).
    ``pooling`` with a generative architecture converts it (``convert="auto"`` -> ``embed``: its
    final hidden states pooled, last token by default: Qwen3-Embedding); ``generate`` with an
    encoder is refused. A plugin's architecture generates unless its registry entry says otherwise.
    """
    if runner not in (*RUNNERS, "auto"):
        raise ConfigError("model.runner", f"must be one of auto, {', '.join(RUNNERS)}, got {runner!r}")
    if convert not in (*CONVERTS, "auto"):
        raise ConfigError("model.convert", f"must be one of auto, {', '.join(CONVERTS)}, got {convert!r}")
    info = architecture_info(architecture)
    own = info.runner if info is not None else GENERATE
    tasks = info.tasks if info is not None else (GENERATE,)
    runner = own if runner == "auto" else runner
    if own == POOLING:
        if runner != POOLING:
            raise ConfigError("model.runner", f"{architecture!r} is a pooling model ({', '.join(tasks)}): "
                                              "serve it with runner 'pooling'")
        if convert not in ("auto", "none"):
            raise ConfigError("model.convert", f"{architecture!r} is a pooling model already")
        return RunnerChoice(POOLING, "none", tasks)
    if runner == GENERATE:
        if convert not in ("auto", "none"):
            raise ConfigError("model.convert", f"{convert!r} applies to runner 'pooling' only")
        return RunnerChoice(GENERATE, "none", tasks)
    if convert == "none":
        raise ConfigError("model.convert", f"{architecture!r} generates; runner 'pooling' needs convert 'embed'")
    return RunnerChoice(POOLING, "embed", ("embed",))


_TARGET = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class _ModelRegistry:
    """Architecture name -> the model registered for it by a plugin (built-ins are implicit)."""

    def __init__(self) -> None:
        self._models: dict[str, Union[str, type]] = {}
        self._lock = threading.Lock()

    def register_model(self, architecture: str, model_cls: Union[str, type]) -> None:
        """Register ``model_cls`` (``"package.module:Class"``, imported only by the worker, or the
        class itself) for checkpoints whose ``architectures`` names ``architecture``. A plugin may
        replace a built-in (logged)."""
        if not isinstance(architecture, str) or not architecture.isidentifier():
            raise InvalidArgumentError("architecture", f"must be a class name, got {architecture!r}")
        if isinstance(model_cls, str):
            if not _TARGET.match(model_cls):
                raise InvalidArgumentError("model_cls", f"must be 'package.module:Class', got {model_cls!r}")
        elif not isinstance(model_cls, type):
            raise InvalidArgumentError("model_cls", f"must be a 'module:Class' string or a class, got {model_cls!r}")
        with self._lock:
            if architecture in BUILTIN_ARCHITECTURES or architecture in self._models:
                logger.warning("model architecture %s is now served by %s", architecture, _name(model_cls))
            self._models[architecture] = model_cls

    def get_supported_archs(self) -> list[str]:
        """Every architecture a worker can build: the built-ins and the registered ones."""
        with self._lock:
            return sorted(set(BUILTIN_ARCHITECTURES) | set(self._models))

    def is_supported(self, architecture: str) -> bool:
        return architecture in BUILTIN_ARCHITECTURES or architecture in self._models

    def registered(self, architecture: str) -> Union[str, type, None]:
        """What a plugin registered for ``architecture`` (None: a built-in or nothing)."""
        with self._lock:
            return self._models.get(architecture)

    def check_architecture(self, architecture: str) -> None:
        """Refuse an architecture nobody registered, naming the ones that are."""
        if not self.is_supported(architecture):
            raise ConfigError(
                "model.architecture",
                f"{architecture or '(none in config.json)'!r} is not a registered architecture; "
                f"registered: {', '.join(self.get_supported_archs())}",
            )

    def unregister(self, architecture: str) -> None:
        """Forget a plugin's model (tests)."""
        with self._lock:
            self._models.pop(architecture, None)


def _name(model_cls: Union[str, type]) -> str:
    return model_cls if isinstance(model_cls, str) else f"{model_cls.__module__}:{model_cls.__qualname__}"


ModelRegistry = _ModelRegistry()
