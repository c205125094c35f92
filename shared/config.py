"""One configuration object, built once and handed to every component.

``GridserveConfig`` groups the model, cache, scheduler, parallel and device sub-configs
(the analogue of vLLM's ``VllmConfig``). Every sub-config is default-constructible so a unit
test can build a single component alone; invalid values raise ``ConfigError`` naming the field.
Nothing here imports torch: the engine and gateway read the model's ``config.json`` as JSON.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from gridserve.shared import envs
from gridserve.shared.errors import ConfigError
from gridserve.shared.generation_config import check_generation_config, read_default_sampling_params
from gridserve.shared.gguf_config import hf_config_from_gguf, is_gguf
from gridserve.shared.kv_transfer import KV_ROLES
from gridserve.shared.model_registry import (
    ARCHITECTURES,
    ModelRegistry,
    architecture_info,
    resolve_runner,
)
from gridserve.shared.parallel import check_model_shardable, kv_head_shard, stage_layers
from gridserve.shared.plugins import load_general_plugins
from gridserve.shared.pooling import PoolerConfig, max_input_tokens, num_labels

_CLASS_TARGET = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
DTYPES = ("auto", "float32", "float16", "bfloat16")
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
# vLLM's KV-cache dtypes; "auto" stores K/V in the weights' dtype. fp8 keeps a per-tensor scale.
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")
KV_DTYPE_BYTES = {**DTYPE_BYTES, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
# Weight quantization applied at load (``quantization=``); "compressed-tensors" is detected from
# a pre-quantized checkpoint's config.json, never asked for.
QUANTIZATION_METHODS = ("int8", "int4")
DEVICES = ("auto", "cpu", "cuda")
EXECUTORS = ("uni", "grpc", "ray")
# --scheduling-policy: first come first served, or by each request's priority (lower first).
FCFS, PRIORITY = "fcfs", "priority"
SCHEDULING_POLICIES = (FCFS, PRIORITY)
# speculative_config's methods: prompt lookup, or a small draft model (vLLM's names).
NGRAM, DRAFT_MODEL = "ngram", "draft_model"
SPECULATIVE_METHODS = (NGRAM, DRAFT_MODEL)



# The engine's size keys and the older spellings some architectures' config.json use instead
# (GPT-2 / GPT-J / Bloom: n_layer, n_head, n_embd; ...), first found wins.
_SIZE_ALIASES = {
    "num_hidden_layers": ("n_layer", "num_layers"),
    "num_attention_heads": ("n_head", "num_heads"),
    "hidden_size": ("n_embd", "n_embed", "d_model"),
    "max_position_embeddings": ("n_positions", "seq_length"),
}


def with_standard_sizes(hf_config: dict) -> dict:
    """``hf_config`` (and its ``text_config``) with the engine's size keys filled in from an
    architecture's own spellings, so the KV cache, the limits and the parallel checks read one name.
    Keys already present are kept; the models read their own spellings either way."""
    cfg = dict(hf_config)
    if isinstance(cfg.get("text_config"), dict):
        cfg["text_config"] = with_standard_sizes(cfg["text_config"])
    for key, aliases in _SIZE_ALIASES.items():
        if cfg.get(key) is None:
            found = next((cfg[a] for a in aliases if cfg.get(a) is not None), None)
            if found is not None:
                cfg[key] = found
    if cfg.get("model_type") == "falcon" and cfg.get("num_key_value_heads") is None:
        heads = cfg.get("num_attention_heads")
        if cfg.get("new_decoder_architecture"):
            cfg["num_key_value_heads"] = cfg.get("num_kv_heads") or heads
        else:  # the older form: one K/V head shared by all (multi_query) or one per head
            cfg["num_key_value_heads"] = 1 if cfg.get("multi_query", True) else heads
    return cfg


def _positive(section: str, name: str, value: Optional[int], allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{section}.{name}", f"must be a positive integer, got {value!r}")


@dataclass
class ModelConfig:
    """Which model to run and how its weights are interpreted.

    ``resolve()`` turns ``model`` (a local folder or a hub id) into ``model_path`` and fills the
    architecture fields from ``config.json``; until then the derived fields keep their defaults.
    """

    model: str = ""
    tokenizer: Optional[str] = None
    dtype: str = "auto"
    seed: int = 0
    max_model_len: Optional[int] = None
    revision: Optional[str] = None
    max_logprobs: int = 20
    # Weights quantized while they load: None (as stored), "int8" or "int4"; per layer by prefix
    # with ``quantization_config`` ({"method": ..., "ignore": [names or "re:" patterns]}).
    quantization: Optional[str] = None
    quantization_config: dict = field(default_factory=dict)
    # Sampling defaults for the fields a request leaves out (shared/generation_config.py): "auto"
    # (the checkpoint's generation_config.json), "vllm" (none) or a folder holding one.
    generation_config: str = "auto"
    # What serves the model (vLLM's --runner): "auto" (the architecture's own), "generate" or
    # "pooling" (embeddings / scores, no tokens); ``convert`` "embed": a generative checkpoint
    # served as an embedder (vLLM's --convert; "auto": embed under the pooling runner).
    runner: str = "auto"
    convert: str = "auto"
    # A pooling model's pooler (vLLM's --pooler-config): {"pooling_type": "MEAN" | "CLS" | "LAST",
    # "normalize": bool, "dimensions": int, "activation": ...} over the checkpoint's own settings.
    pooler_config: dict = field(default_factory=dict)
    # Derived by resolve():
    model_path: str = ""
    architecture: str = ""
    hf_config: dict = field(default_factory=dict, repr=False)
    num_layers: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    vocab_size: int = 0
    resolved_dtype: str = "float32"
    # What ``generation_config`` gave, as SamplingParams keywords ({"temperature": 0.6, ...}).
    default_sampling_params: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError("model.dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        _positive("model", "max_model_len", self.max_model_len)
        if self.max_logprobs < 0:
            raise ConfigError("model.max_logprobs", f"must be non-negative, got {self.max_logprobs}")
        self._check_quantization()
        check_generation_config(self.generation_config)
        if isinstance(self.pooler_config, str):
            try:
                self.pooler_config = json.loads(self.pooler_config) if self.pooler_config else {}
            except ValueError as exc:
                raise ConfigError("model.pooler_config", f"is not valid JSON: {exc}") from None
        if self.pooler_config is None:
            self.pooler_config = {}
        if not isinstance(self.pooler_config, dict):
            raise ConfigError("model.pooler_config", f"must be a JSON object, got {self.pooler_config!r:.200}")

    def _check_quantization(self) -> None:
        qc = self.quantization_config
        if isinstance(qc, str):
            try:
                qc = json.loads(qc) if qc.strip() else {}
            except json.JSONDecodeError as exc:
                raise ConfigError("model.quantization_config", f"is not valid JSON: {exc}") from None
        if not isinstance(qc, dict):
            raise ConfigError("model.quantization_config", f"must be a JSON object, got {qc!r}")
        unknown = set(qc) - {"method", "ignore", "group_size", "weight_only", "activation_rows",
                             "activation_group"}
        if unknown:
            raise ConfigError("model.quantization_config", f"unknown keys {sorted(unknown)}")
        ignore = qc.get("ignore", [])
        if not isinstance(ignore, list) or not all(isinstance(x, str) and x for x in ignore):
            raise ConfigError("model.quantization_config.ignore",
                              f"must be a list of names, got {ignore!r}")
        if not isinstance(qc.get("weight_only", False), bool):
            raise ConfigError("model.quantization_config.weight_only",
                              f"must be true or false, got {qc['weight_only']!r}")
        rows = qc.get("activation_rows", 2)
        if rows not in (1, 2) or isinstance(rows, bool):
            raise ConfigError("model.quantization_config.activation_rows",
                              f"must be 1 (int8, one scale per row: coarser) or 2 (16-bit), got {rows!r}")
        act_group = qc.get("activation_group", 0)
        if act_group not in (0, 32) or isinstance(act_group, bool):
            raise ConfigError("model.quantization_config.activation_group",
                              f"must be 32 (int8 activations, one scale per 32 columns) or 0 (one "
                              f"scale per row, see activation_rows), got {act_group!r}")
        if act_group and "activation_rows" in qc:
            raise ConfigError("model.quantization_config.activation_rows",
                              "applies to per-row activations only (activation_group 0), "
                              "not with activation_group 32")
        group = qc.get("group_size", 128)
        if not isinstance(group, int) or isinstance(group, bool) or group < 1:
            raise ConfigError("model.quantization_config.group_size",
                              f"must be a positive integer, got {group!r}")
        method = qc.get("method", self.quantization)
        if self.quantization is not None and method != self.quantization:
            raise ConfigError("model.quantization_config.method",
                              f"{method!r} disagrees with quantization={self.quantization!r}")
        if method is not None and method not in QUANTIZATION_METHODS + ("compressed-tensors",):
            field_name = "model.quantization" if self.quantization else "model.quantization_config.method"
            raise ConfigError(field_name, f"must be one of {QUANTIZATION_METHODS}, got {method!r}")
        if qc and method is None:
            raise ConfigError("model.quantization_config.method", "is required")
        self.quantization = method
        self.quantization_config = {**qc, "method": method} if method else {}

    def resolve(self) -> ModelConfig:
        """Locate the checkpoint and read its architecture. Idempotent."""
        from gridserve.shared.hf import resolve_model_path

        if not self.model:
            raise ConfigError("model.model", "no model given (a local folder or a hub id)")
        self.model_path = str(resolve_model_path(self.model, self.revision))
        if is_gguf(self.model_path):  # one GGUF file: its metadata is the config
            cfg = hf_config_from_gguf(self.model_path)
        else:
            with open(Path(self.model_path) / "config.json", encoding="utf-8") as f:
                cfg = json.load(f)
        self.hf_config = with_standard_sizes(cfg)
        archs = cfg.get("architectures") or []
        self.architecture = archs[0] if archs else ""
        cfg = self.text_config  # a vision-language model: the language model's sizes
        self.num_layers = int(cfg.get("num_hidden_layers", 0))
        heads = int(cfg.get("num_attention_heads", 0))
        self.num_kv_heads = int(cfg.get("num_key_value_heads") or heads)
        hidden = int(cfg.get("hidden_size", 0))
        self.head_dim = int(cfg.get("head_dim") or (hidden // heads if heads else 0))
        self.vocab_size = int(cfg.get("vocab_size", 0))
        self._detect_prequantized(cfg.get("quantization_config"))
        self.resolved_dtype = self._resolve_dtype(cfg)
        self.default_sampling_params = read_default_sampling_params(self.model_path, self.generation_config)
        limit = int(cfg.get("max_position_embeddings") or 2048)
        if self.max_model_len is None:
            self.max_model_len = limit
        elif self.max_model_len > limit:
            raise ConfigError(
                "model.max_model_len",
                f"{self.max_model_len} exceeds the model's max_position_embeddings={limit}",
            )
        return self

    def _detect_prequantized(self, saved: Optional[dict]) -> None:
        """A checkpoint saved quantized (compressed-tensors) is read as such, never re-quantized."""
        if not saved:
            return
        method = saved.get("quant_method")
        if method != "compressed-tensors":
            raise ConfigError("model.model",
                              f"checkpoint quantization {method!r} is not supported; "
                              "supported: 'compressed-tensors' (int8 / int4 weight-only)")
        if self.quantization not in (None, "compressed-tensors"):
            raise ConfigError("model.quantization",
                              "the checkpoint is already quantized (compressed-tensors); "
                              f"got {self.quantization!r}")
        self.quantization = "compressed-tensors"
        self.quantization_config = {"method": "compressed-tensors"}

    def _resolve_dtype(self, cfg: dict) -> str:
        if self.dtype != "auto":
            return self.dtype
        saved = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
        # Half precision on CPU is slow and lossy; vLLM's CPU backend also prefers fp32/bf16.
        return saved if saved in DTYPE_BYTES else "float32"

    @property
    def text_config(self) -> dict:
        """The language model's config: ``text_config`` of a vision-language model, else the whole."""
        return self.hf_config.get("text_config") or self.hf_config

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.model_path or self.model

    @property
    def eos_token_id(self) -> Optional[int]:
        eos = self.hf_config.get("eos_token_id", self.text_config.get("eos_token_id"))
        if isinstance(eos, list):
            return eos[0] if eos else None
        return eos

    def kv_bytes_per_token(self, kv_cache_dtype: str = "auto") -> int:
        """Bytes of K and V that one token occupies across all layers, stored as ``kv_cache_dtype``."""
        dtype = self.resolved_dtype if kv_cache_dtype == "auto" else kv_cache_dtype
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * KV_DTYPE_BYTES[dtype]


@dataclass
class CacheConfig:
    """The paged KV cache: block size, prefix caching and how much memory it may take."""

    block_size: int = 16
    enable_prefix_caching: bool = True
    # How K/V are stored: "auto" (the weights' dtype), 16-bit, or fp8 with a per-tensor scale.
    kv_cache_dtype: str = "auto"
    kv_cache_memory_bytes: Optional[int] = None
    gpu_memory_utilization: float = 0.9
    # Set by the engine once the workers report the memory they can give the cache.
    num_blocks: Optional[int] = None
    # Plan every layer as full attention (one KV cache group), even window layers: they stay masked
    # to their window but keep every token (to compare, or to rule the hybrid allocator out).
    disable_hybrid_kv_cache_manager: bool = False
    # Disaggregated prefill / decode (``shared/kv_transfer.py``): kv_producer runs prompts only and
    # keeps their blocks for a consumer to pull (for ``kv_transfer_timeout_s``); kv_consumer pulls
    # them and decodes; kv_both does either. None: neither.
    kv_role: Optional[str] = None
    kv_transfer_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        _positive("cache", "block_size", self.block_size, allow_none=False)
        if self.kv_role is not None and self.kv_role not in KV_ROLES:
            raise ConfigError("cache.kv_role", f"must be one of {KV_ROLES}, got {self.kv_role!r}")
        if not self.kv_transfer_timeout_s > 0:
            raise ConfigError("cache.kv_transfer_timeout_s", f"must be positive, got {self.kv_transfer_timeout_s}")
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ConfigError("cache.block_size", f"must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        _positive("cache", "kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError("cache.kv_cache_dtype",
                              f"must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                "cache.gpu_memory_utilization",
                f"must be in (0, 1], got {self.gpu_memory_utilization}",
            )


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``speculative_config``): a proposer suggests up to
    ``num_speculative_tokens`` tokens that the target model verifies in one step.

    ``method``: ``"ngram"`` (prompt lookup: the tokens that followed the sequence's last n tokens
    earlier in it) or ``"draft_model"`` (a small model with the target's vocabulary, ``model``: a
    folder or hub id; ``{"model": PATH}`` alone means ``draft_model``, as in vLLM). The draft runs
    in the target's (driver) worker with the target's dtype, its layers in the same KV cache pool;
    it proposes greedily for greedy requests and samples from its distribution for the others.
    ``prompt_lookup_max`` .. ``prompt_lookup_min``: the n-gram lengths tried, longest first (n-gram
    only). ``disable_by_batch_size``: no drafts while this many requests or more run (verifying
    costs compute a large batch has no room for).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    disable_by_batch_size: int = 8
    model: Optional[str] = None  # the draft model (``draft_model`` only)

    @classmethod
    def from_dict(cls, values: dict) -> SpeculativeConfig:
        if not isinstance(values, dict):
            raise ConfigError("speculative_config", f"must be an object, got {type(values).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ConfigError(f"speculative_config.{unknown[0]}", f"unknown; known: {sorted(known)}")
        if "model" in values and "method" not in values:
            values = {**values, "method": DRAFT_MODEL}
        config = cls(**values)
        if config.method not in SPECULATIVE_METHODS:
            raise ConfigError("speculative_config.method",
                              f"must be one of {SPECULATIVE_METHODS}, got {config.method!r}")
        if config.method == DRAFT_MODEL and (not isinstance(config.model, str) or not config.model):
            raise ConfigError("speculative_config.model",
                              f"method \"draft_model\" needs the draft model's folder or hub id, got {config.model!r}")
        if config.method != DRAFT_MODEL and config.model is not None:
            raise ConfigError("speculative_config.model", f"applies to method \"draft_model\" only, not {config.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"):
            value = getattr(config, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"speculative_config.{name}", f"must be a positive integer, got {value!r}")
        if config.num_speculative_tokens > 16:
            raise ConfigError("speculative_config.num_speculative_tokens",
                              f"must be at most 16, got {config.num_speculative_tokens}")
        if config.prompt_lookup_max < config.prompt_lookup_min:
            raise ConfigError("speculative_config.prompt_lookup_max",
                              f"must be >= prompt_lookup_min ({config.prompt_lookup_min}), got {config.prompt_lookup_max}")
        return config

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots a request needs past its scheduled tokens: a draft model writes the K / V of the
        tokens it proposes (the bonus token and ``k - 1`` drafts) in the request's own blocks."""
        return self.num_speculative_tokens if self.method == DRAFT_MODEL else 0

    def draft_model_config(self, target: ModelConfig) -> ModelConfig:
        """The draft model's resolved config (the target's dtype and length), checked against the
        target at start: the same vocabulary, room for ``max_model_len`` positions. (With tensor
        parallelism the driver worker runs the whole draft.)"""
        field_name = "speculative_config.model"
        try:
            draft = ModelConfig(model=self.model, dtype=target.resolved_dtype, generation_config="vllm").resolve()
        except (OSError, ValueError) as exc:
            raise ConfigError(field_name, f"cannot read the draft model {self.model!r}: {exc}") from None
        if draft.vocab_size != target.vocab_size:
            raise ConfigError(field_name, f"the draft's vocabulary has {draft.vocab_size} tokens, the target's "
                                          f"{target.vocab_size}: a draft model must share the target's tokenizer")
        if draft.max_model_len < target.max_model_len:
            raise ConfigError(field_name, f"the draft holds {draft.max_model_len} positions, fewer than "
                                          f"max_model_len={target.max_model_len}")
        draft.max_model_len = target.max_model_len
        if draft.quantization is not None or "vision_config" in draft.hf_config:
            raise ConfigError(field_name, "the draft must be a plain (unquantized, text-only) checkpoint")
        return draft


@dataclass
class SchedulerConfig:
    """Token budget and sequence cap of one scheduling step."""

    max_num_seqs: int = 256
    max_num_batched_tokens: Optional[int] = None
    enable_chunked_prefill: bool = True
    # Admission control: new requests beyond this many waiting are refused (None: ``waiting_limit``).
    max_waiting_requests: Optional[int] = None
    # Speculative decoding, vLLM's dict (``SpeculativeConfig``; empty: off). A JSON string is parsed.
    speculative_config: dict = field(default_factory=dict)
    # Which request runs first: "fcfs" (arrival) or "priority" (each request's priority, lower first;
    # a better request preempts a worse running one). ``services/engine/scheduling_policy.py``.
    scheduling_policy: str = FCFS

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigError("scheduler.scheduling_policy",
                              f"must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        _positive("scheduler", "max_num_seqs", self.max_num_seqs, allow_none=False)
        _positive("scheduler", "max_waiting_requests", self.max_waiting_requests)
        _positive("scheduler", "max_num_batched_tokens", self.max_num_batched_tokens)
        if isinstance(self.speculative_config, str):
            try:
                self.speculative_config = json.loads(self.speculative_config) if self.speculative_config else {}
            except ValueError as exc:
                raise ConfigError("speculative_config", f"is not JSON: {exc}") from None
        if self.speculative_config is None:
            self.speculative_config = {}
        if self.speculative_config:  # checked now: a bad dict fails at start, naming the field
            SpeculativeConfig.from_dict(self.speculative_config)

    @property
    def speculative(self) -> Optional[SpeculativeConfig]:
        """The checked speculative-decoding settings, or None when off."""
        return SpeculativeConfig.from_dict(self.speculative_config) if self.speculative_config else None

    @property
    def waiting_limit(self) -> int:
        """``max_waiting_requests``, by default max(1024, 4 x ``max_num_seqs``). A waiting request
        holds no KV blocks, and the engine takes at most ``max_num_seqs`` into a step (fewer when
        the KV cache is short), so four full batches of waiting work is already minutes of queue on
        a CPU; past it a 429 (the gateway tries the next engine first) serves a client better than
        an ever longer wait, and bounds the prompts an engine holds. The floor of 1024 admits
        workload W (256 requests at once) whole on one engine at any ``max_num_seqs``."""
        if self.max_waiting_requests is not None:
            return self.max_waiting_requests
        return max(1024, 4 * self.max_num_seqs)

    def finalize(self, max_model_len: int) -> None:
        """Fill the token budget default once the model length is known and check they agree."""
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 2048 if self.enable_chunked_prefill else max(max_model_len, 2048)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
            raise ConfigError(
                "scheduler.max_num_batched_tokens",
                f"{self.max_num_batched_tokens} is smaller than max_model_len={max_model_len}; "
                "enable chunked prefill or raise the budget",
            )


@dataclass
class ParallelConfig:
    """How many workers and which executor drives them."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    executor_backend: str = "uni"
    # Addresses (host:port) of the worker services the ``grpc`` executor drives, rank order.
    worker_addresses: list[str] = field(default_factory=list)
    # host:port where the workers rendezvous for torch.distributed (rank 0 listens there). Empty:
    # the engine picks a free loopback port (workers on the engine's machine).
    distributed_init_address: str = ""
    # "module:Class" mixed into every worker; its public methods are callable by name through
    # ``collective_rpc`` (e.g. RLHF weight sync). Imported only by the workers.
    worker_extension_cls: str = ""
    # Expert parallelism (``--enable-expert-parallel``, DP > 1): each DP engine's workers hold
    # 1 / DP of every MoE layer's experts and exchange tokens over a DP-wide torch.distributed
    # group whose rendezvous (host:port, served by DP rank 0's first worker) is
    # ``expert_parallel_init_address``; ``data_parallel_rank`` is this engine's place in it.
    enable_expert_parallel: bool = False
    expert_parallel_init_address: str = ""
    data_parallel_rank: int = 0

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            _positive("parallel", name, getattr(self, name), allow_none=False)
        if not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ConfigError("parallel.data_parallel_rank",
                              f"must be in [0, data_parallel_size={self.data_parallel_size}), "
                              f"got {self.data_parallel_rank}")
        if self.enable_expert_parallel and self.pipeline_parallel_size > 1:
            raise ConfigError("parallel.pipeline_parallel_size",
                              "expert parallelism (--enable-expert-parallel) needs 1 pipeline stage, "
                              f"got {self.pipeline_parallel_size}")
        if self.worker_extension_cls and not _CLASS_TARGET.match(self.worker_extension_cls):
            raise ConfigError("parallel.worker_extension_cls",
                              f"must be 'package.module:Class', got {self.worker_extension_cls!r}")
        if self.executor_backend not in EXECUTORS:
            raise ConfigError(
                "parallel.executor_backend", f"must be one of {EXECUTORS}, got {self.executor_backend!r}"
            )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def expert_parallel_size(self) -> int:
        """DP engines the experts are split across (1: every engine holds them all)."""
        return self.data_parallel_size if self.enable_expert_parallel else 1

    def check_model(self, architecture: str, hf_config: dict) -> None:
        """Refuse, naming the field, a model this parallel layout cannot split."""
        info = architecture_info(architecture)
        for name, feature in (("tensor_parallel_size", "tensor_parallel"),
                              ("pipeline_parallel_size", "pipeline_parallel")):
            if getattr(self, name) > 1 and (info is None or not getattr(info, feature)):
                supported = [a.name for a in ARCHITECTURES.values() if getattr(a, feature)]
                raise ConfigError(
                    f"parallel.{name}",
                    f"{architecture!r} does not support it; supported: {', '.join(sorted(supported))}",
                )
        if self.world_size > 1:
            check_model_shardable(hf_config, self.tensor_parallel_size, self.pipeline_parallel_size)


def batch_invariant_from_env() -> bool:
    """``GRIDSERVE_BATCH_INVARIANT`` set to anything but empty / 0 / false."""
    return envs.GRIDSERVE_BATCH_INVARIANT


@dataclass
class DeviceConfig:
    """Which device the workers run on; ``auto`` picks CUDA when the worker sees one.

    ``batch_invariant`` (``--batch-invariant``, ``GRIDSERVE_BATCH_INVARIANT=1``): every token's
    logits bitwise independent of the batch it shares and of prefill vs decode, so seeded samples
    too are the same in any batch mix (CPU only; ``services/worker/batch_invariant.py``).
    """

    device: str = "auto"
    batch_invariant: bool = field(default_factory=batch_invariant_from_env)
    # Decode-step CUDA graphs (``services/worker/cuda_graphs.py``): off with ``--enforce-eager``; the
    # batch sizes captured (``--cuda-graph-sizes``; empty: 1, 2, 4, 8 and multiples of 8 up to
    # min(512, max_num_seqs)). Never used on CPU or with ``batch_invariant``.
    enforce_eager: bool = False
    cuda_graph_sizes: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.cuda_graph_sizes, str):  # "1,2,4,8" from the command line
            self.cuda_graph_sizes = [int(s) for s in self.cuda_graph_sizes.replace(" ", "").split(",") if s]
        self.cuda_graph_sizes = list(self.cuda_graph_sizes or [])
        if not isinstance(self.enforce_eager, bool):
            raise ConfigError("device.enforce_eager", f"must be true or false, got {self.enforce_eager!r}")
        if any(not isinstance(s, int) or s < 1 for s in self.cuda_graph_sizes):
            raise ConfigError("device.cuda_graph_sizes", f"must be positive integers, got {self.cuda_graph_sizes!r}")
        if self.device not in DEVICES:
            raise ConfigError("device.device", f"must be one of {DEVICES}, got {self.device!r}")
        if not isinstance(self.batch_invariant, bool):
            raise ConfigError("device.batch_invariant", f"must be true or false, got {self.batch_invariant!r}")
        if self.batch_invariant and self.device == "cuda":
            raise ConfigError("device.batch_invariant", "batch-invariant mode is implemented for the CPU only")


MAX_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's accepted --max-lora-rank values


def parse_lora_modules(text: str) -> dict[str, str]:
    """``--lora-modules``: ``name=path`` pairs (spaces or commas between them), or vLLM's JSON form
    (a list of ``{"name": ..., "path": ...}`` objects or one such object), or a ``{name: path}``
    JSON object (what the Helm chart passes)."""
    text = text.strip()
    if not text:
        return {}
    if text[0] in "[{":
        try:
            value = json.loads(text)
        except ValueError as exc:
            raise ConfigError("lora.lora_modules", f"is not JSON: {exc}") from None
        if isinstance(value, dict) and not ({"name", "path"} <= set(value)):
            value = [{"name": k, "path": v} for k, v in value.items()]
        items = value if isinstance(value, list) else [value]
        modules = {}
        for item in items:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not isinstance(item.get("path"), str):
                raise ConfigError("lora.lora_modules", f"each entry needs a string name and path, got {item!r:.200}")
            modules[item["name"]] = item["path"]
        return modules
    modules = {}
    for pair in re.split(r"[\s,]+", text):
        name, sep, path = pair.partition("=")
        if not sep or not name or not path:
            raise ConfigError("lora.lora_modules", f"expected name=path, got {pair!r:.200}")
        modules[name] = path
    return modules


@dataclass
class LoRAConfig:
    """Multi-LoRA serving (vLLM's ``enable_lora`` and friends): adapters of the base model, loaded
    by the workers from PEFT folders and mixed in one batch. ``lora_modules`` ({name: path}) are
    served from the start; more are loaded at run time when ``allow_runtime_lora_updating``."""

    enable_lora: bool = False
    max_loras: int = 1  # distinct adapters in one step (more wait)
    max_lora_rank: int = 16
    max_cpu_loras: Optional[int] = None  # adapters each worker keeps loaded (LRU); None: max_loras
    lora_dir: Optional[str] = None  # served adapter paths must lie in it
    allow_runtime_lora_updating: bool = False
    lora_modules: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("enable_lora", "allow_runtime_lora_updating"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"lora.{name}", f"must be true or false, got {getattr(self, name)!r}")
        _positive("lora", "max_loras", self.max_loras, allow_none=False)
        _positive("lora", "max_cpu_loras", self.max_cpu_loras)
        if self.max_lora_rank not in MAX_LORA_RANKS:
            raise ConfigError("lora.max_lora_rank", f"must be one of {MAX_LORA_RANKS}, got {self.max_lora_rank!r}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError("lora.max_cpu_loras",
                              f"must be at least max_loras ({self.max_loras}), got {self.max_cpu_loras}")
        if self.lora_modules is None:
            self.lora_modules = {}
        if isinstance(self.lora_modules, str):
            self.lora_modules = parse_lora_modules(self.lora_modules)
        if not isinstance(self.lora_modules, dict) or not all(
                isinstance(k, str) and k and isinstance(v, str) and v for k, v in self.lora_modules.items()):
            raise ConfigError("lora.lora_modules", f"must map adapter names to folders, got {self.lora_modules!r:.200}")
        if self.lora_modules and not self.enable_lora:
            raise ConfigError("lora.lora_modules", "adapters are served only with --enable-lora")
        if self.lora_dir == "":
            self.lora_dir = None

    @property
    def cpu_loras(self) -> int:
        """How many adapters a worker keeps loaded."""
        return self.max_cpu_loras or self.max_loras


@dataclass
class GridserveConfig:
    """Everything a component may need, grouped by concern. Build once, pass everywhere."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    @property
    def max_model_len(self) -> int:
        return self.model.max_model_len or 2048

    def finalize(self) -> GridserveConfig:
        """Resolve the model and fill defaults that depend on it."""
        self.model.resolve()
        load_general_plugins()  # a plugin may register the checkpoint's architecture
        ModelRegistry.check_architecture(self.model.architecture)
        choice = resolve_runner(self.model.architecture, self.model.runner, self.model.convert)
        self.model.runner, self.model.convert = choice.runner, choice.convert
        if choice.runner == "pooling":
            self._finalize_pooling()
        elif self.model.pooler_config:
            raise ConfigError("model.pooler_config", "applies to pooling models (--runner pooling) only")
        self.parallel.check_model(self.model.architecture, self.model.text_config)
        self.scheduler.finalize(self.max_model_len)
        if self.scheduler.speculative_config and self.parallel.pipeline_parallel_size > 1:
            raise ConfigError("speculative_config", "speculative decoding with pipeline parallelism (-pp > 1) "
                                                    "is not supported")
        if self.lora.enable_lora and self.scheduler.speculative_config:
            raise ConfigError("enable_lora", "LoRA with speculative decoding is not supported yet")
        spec = self.scheduler.speculative
        if spec is not None and spec.method == DRAFT_MODEL:  # read now: a bad draft fails the start
            spec.draft_model_config(self.model)
        if self.cache.kv_role and self.model.runner == "pooling":
            raise ConfigError("cache.kv_role", "a pooling model keeps no KV cache to transfer")
        if self.lora.enable_lora and "vision_config" in self.model.hf_config:
            raise ConfigError("enable_lora", f"LoRA on a vision-language model ({self.model.architecture}) "
                                             "is not supported yet")
        return self

    def _finalize_pooling(self) -> None:
        """A pooling model runs each input whole, in one step, without a KV cache: the input limit is
        the model's (XLM-R: its position table less the padding offset) and the step budget holds one."""
        PoolerConfig.of(self.model.pooler_config)  # checked now: a bad key fails the start, naming it
        limit = max_input_tokens(self.model.architecture, self.model.hf_config)
        if limit is not None and self.model.max_model_len > limit:
            self.model.max_model_len = limit
        budget = self.scheduler.max_num_batched_tokens
        if budget is None:
            self.scheduler.max_num_batched_tokens = max(self.max_model_len, 2048)
        elif budget < self.max_model_len:
            raise ConfigError("scheduler.max_num_batched_tokens", f"{budget} is smaller than max_model_len="
                              f"{self.max_model_len}: a pooling model runs each input in one step")
        if self.parallel.pipeline_parallel_size > 1:
            raise ConfigError("parallel.pipeline_parallel_size", "a pooling model runs on one pipeline stage")
        if self.lora.enable_lora:
            raise ConfigError("enable_lora", "LoRA with a pooling model is not supported yet")
        if self.scheduler.speculative_config:
            raise ConfigError("speculative_config", "speculative decoding applies to generation only")

    @property
    def pooling_tasks(self) -> tuple[str, ...]:
        """What a pooling model serves: its architecture's tasks; "score" from a classifier only with
        one label (a cross-encoder); a converted decoder embeds."""
        if self.model.runner != "pooling":
            return ("generate",)
        if self.model.convert == "embed":
            return ("embed",)
        tasks = resolve_runner(self.model.architecture, "pooling").tasks
        if "score" in tasks and num_labels(self.model.hf_config) != 1:
            tasks = tuple(t for t in tasks if t != "score")
        return tasks

    def kv_bytes_per_token_per_rank(self) -> int:
        """Bytes of K and V one token occupies on the busiest worker: its stage's layers, its heads."""
        p, m = self.parallel, self.model
        if p.world_size == 1:
            return m.kv_bytes_per_token(self.cache.kv_cache_dtype)
        layers = stage_layers(m.num_layers, p.pipeline_parallel_size, 0).size  # stage 0 is the largest
        heads = kv_head_shard(m.num_kv_heads, p.tensor_parallel_size, 0).size
        return 2 * layers * heads * m.head_dim * KV_DTYPE_BYTES[self.kv_cache_dtype]

    @property
    def kv_cache_dtype(self) -> str:
        """The KV cache's storage dtype with "auto" resolved to the weights' dtype."""
        dtype = self.cache.kv_cache_dtype
        return self.model.resolved_dtype if dtype == "auto" else dtype

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> GridserveConfig:
        """Build from flat vLLM-style keyword arguments (``LLM(model=..., block_size=...)``).

        An unknown argument is an error, never silently ignored.
        """
        sections: dict[str, dict[str, Any]] = {name: {} for name in _SECTIONS}
        for key, value in kwargs.items():
            section = _FLAT_TO_SECTION.get(key)
            if section is None:
                raise ConfigError(key, f"unknown argument {key!r}; known: {sorted(_FLAT_TO_SECTION)}")
            sections[section][_RENAMED.get(key, key)] = value
        return cls(**{name: _SECTIONS[name](**values) for name, values in sections.items()})


_SECTIONS = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "parallel": ParallelConfig,
    "device": DeviceConfig,
    "lora": LoRAConfig,
}
_RENAMED = {"distributed_executor_backend": "executor_backend"}
_DERIVED = {"model_path", "architecture", "hf_config", "num_layers", "num_kv_heads", "head_dim",
            "vocab_size", "resolved_dtype", "num_blocks", "default_sampling_params"}
_FLAT_TO_SECTION = {
    f.name: section
    for section, klass in _SECTIONS.items()
    for f in dataclasses.fields(klass)
    if f.name not in _DERIVED
}
_FLAT_TO_SECTION["distributed_executor_backend"] = "parallel"
