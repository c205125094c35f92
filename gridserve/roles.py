"""Command-line options of the roles, shared by ``gridserve worker|engine|gateway|coordinator|serve``.

The engine's options are declared once, in ``ENGINE_OPTIONS``: flags, ``GRIDSERVE_*`` variables,
the ``GridserveConfig`` they build and the Helm values derive from it. Options added with
:func:`add_option` can also come from a ``GRIDSERVE_<OPTION>`` environment variable (e.g.
``GRIDSERVE_WORKERS``, ``GRIDSERVE_MODEL``); a flag wins over the variable. A role started without
a required address fails at once with a message that names the flag and the variable.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from typing import Any, Optional

from gridserve.shared import envs
from gridserve.shared.envs import add_option
from gridserve.shared.errors import ConfigError

logger = logging.getLogger(__name__)

@dataclass(frozen=True)
class EngineOption:
    """One engine option, declared once: the flag, its ``GRIDSERVE_*`` variable, the config key it
    sets and its Helm value all derive from this entry (checked by ``tests/unit/gridserve/test_settings.py``).

    ``config`` is the ``GridserveConfig.from_kwargs`` key (None: the engine's ``serve()`` reads the
    option itself); ``helm`` the chart's value path (None: not a chart value); a ``bool`` option is
    a switch (``store_true``), ``invert`` when the switch turns its config key off.
    """

    flag: str
    kind: Any
    default: Any
    help: str
    config: Optional[str] = None
    helm: Optional[str] = None
    short: Optional[str] = None
    invert: bool = False

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def env(self) -> str:
        return envs.flag_env_name(self.flag)

    def config_value(self, value: Any) -> Any:
        return (not value) if self.invert else value


def _engine_option(flag: str, kind: Any, default: Any, help_text: str, *, config: Optional[str] = "",
                   helm: Optional[str] = "", short: Optional[str] = None, invert: bool = False) -> EngineOption:
    """An option whose config key is its dest and whose Helm value is ``engine.<camelCase dest>``
    unless told otherwise (``None``: none)."""
    dest = flag.lstrip("-").replace("-", "_")
    head, *rest = dest.split("_")
    return EngineOption(flag, kind, default, help_text, config=dest if config == "" else config,
                        helm=f"engine.{head}{''.join(w.title() for w in rest)}" if helm == "" else helm,
                        short=short, invert=invert)


# Engine options. ``gridserve serve`` forwards them to its engine.
ENGINE_OPTIONS: list[EngineOption] = [
    _engine_option("--tokenizer", str, None,
                   "tokenizer folder or hub id, when not the model's own; for a .gguf model it replaces the "
                   "file's embedded tokenizer and chat template (engine, gateway and workers all use it)"),
    _engine_option("--dtype", str, "auto", "weight dtype (auto, float32, float16, bfloat16)"),
    _engine_option("--runner", str, "auto",
                   "what serves the model: auto (its architecture's own), generate (text) or pooling "
                   "(embeddings / scores: /v1/embeddings, /score, /rerank, /classify)"),
    _engine_option("--convert", str, "auto",
                   "with --runner pooling, a generative checkpoint served as: embed (its last token's hidden "
                   "state, e.g. Qwen3-Embedding); auto: embed for a generative model, none for an encoder"),
    _engine_option("--pooler-config", str, None,
                   'a pooling model\'s pooler as JSON over the checkpoint\'s own, e.g. {"pooling_type": "MEAN", '
                   '"normalize": true} (pooling_type MEAN / CLS / LAST, normalize, dimensions, activation)'),
    _engine_option("--max-model-len", int, None, "maximum tokens per sequence (default: the model's)"),
    _engine_option("--max-num-seqs", int, 256, "sequence cap per step"),
    _engine_option("--max-num-batched-tokens", int, None, "token budget per step"),
    _engine_option("--scheduling-policy", str, "fcfs",
                   "which request runs first: fcfs (arrival) or priority (each request's priority, lower first, "
                   "ties by arrival; a better request preempts a worse running one when slots or KV blocks run "
                   "out); fcfs refuses a nonzero priority"),
    _engine_option("--max-waiting-requests", int, None,
                   "admission control: refuse new requests (RESOURCE_EXHAUSTED; HTTP 429 when every engine "
                   "is full) while this many wait (default: max(1024, 4 x --max-num-seqs))"),
    _engine_option("--block-size", int, 16, "tokens per KV block"),
    _engine_option("--kv-cache-memory-bytes", int, None,
                   "KV-cache budget in bytes (default: profiled / 2 GiB on CPU)"),
    _engine_option("--kv-cache-dtype", str, "auto",
                   "KV-cache storage dtype (auto, bfloat16, float16, fp8_e4m3, fp8_e5m2; fp8 with per-tensor "
                   "scales)"),
    _engine_option("--quantization", str, None, "quantize the weights while they load (int8, int4)"),
    _engine_option("--quantization-config", str, None,
                   'per-layer quantization as JSON, e.g. {"method": "int8", "ignore": ["lm_head"]}'),
    _engine_option("--seed", int, 0, "random seed"),
    _engine_option("--generation-config", str, "auto",
                   "sampling defaults for the fields a request leaves out (temperature, top_p, top_k, min_p, "
                   "repetition_penalty, max_new_tokens as max_tokens): auto (the model's generation_config.json), "
                   "vllm (none: the neutral defaults) or a folder holding a generation_config.json"),
    _engine_option("--device", str, "auto", "worker device (auto, cpu, cuda)", helm="worker.device"),
    _engine_option("--tensor-parallel-size", int, 1, "tensor-parallel workers per pipeline stage (-tp)",
                   helm="tensorParallelSize", short="-tp"),
    _engine_option("--pipeline-parallel-size", int, 1, "pipeline stages per engine (-pp)",
                   helm="pipelineParallelSize", short="-pp"),
    _engine_option("--distributed-init-address", str, None,
                   "host:port of the workers' torch.distributed rendezvous (default: a free loopback port)",
                   helm=None),
    _engine_option("--distributed-executor-backend", str, "grpc",
                   "how the engine reaches its workers: grpc (worker services at --workers) or ray (Ray "
                   "places and starts them as actors; RAY_ADDRESS or a local Ray)", helm=None),
    _engine_option("--worker-extension-cls", str, None,
                   "module:Class mixed into every worker; its public methods are callable through "
                   "CollectiveRpc", helm=None),
    _engine_option("--enable-expert-parallel", bool, False,
                   "MoE with --data-parallel-size > 1: each engine's workers hold 1 / DP of every MoE "
                   "layer's experts and exchange tokens with the other engines' (attention stays data-parallel)"),
    _engine_option("--expert-parallel-init-address", str, None,
                   "host:port of the DP-wide expert-parallel rendezvous, the same for every engine (DP rank "
                   "0's first worker listens there; `serve` picks a free loopback port)", helm=None),
    _engine_option("--worker-recovery-timeout", float, 120.0,
                   "seconds a failed worker group may take to come back before in-flight requests fail "
                   "(0: a worker failure kills the engine)", config=None),
    _engine_option("--no-prefix-caching", bool, False, "disable prefix caching",
                   config="enable_prefix_caching", helm="engine.enablePrefixCaching", invert=True),
    _engine_option("--speculative-config", str, None,
                   "speculative decoding as JSON, vLLM's keys: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
                   "\"prompt_lookup_min\": 2, \"prompt_lookup_max\": 4, \"disable_by_batch_size\": 8}' (n-gram "
                   "drafts from the sequence itself) or '{\"model\": DRAFT_PATH, \"num_speculative_tokens\": 4}' "
                   "(a small draft model of the target's vocabulary, run by the driver worker; sampled requests "
                   "verified by rejection sampling). Greedy outputs unchanged, sampled ones keep the target's "
                   "distribution", helm="engine.speculativeConfig"),
    _engine_option("--kv-role", str, None,
                   "disaggregated prefill / decode (gridserve serve --disaggregated P:D): kv_producer (prefill only; "
                   "the prompt's KV blocks kept for a decode engine to pull), kv_consumer (pulls them and decodes) "
                   "or kv_both", helm=None),
    _engine_option("--kv-transfer-timeout", float, None,
                   "seconds a kv_producer keeps a prefilled request's KV blocks for a consumer to pull (default 30)",
                   config="kv_transfer_timeout_s", helm=None),
    _engine_option("--disable-hybrid-kv-cache-manager", bool, False,
                   "plan every layer's KV cache as full attention: sliding-window layers stay masked to their "
                   "window but keep every token (one KV cache group; to compare or rule the hybrid allocator out)",
                   config="disable_hybrid_kv_cache_manager", helm=None),
    _engine_option("--enable-lora", bool, False,
                   "serve LoRA adapters of the base model (PEFT folders); a request names one as its model",
                   helm="lora.enabled"),
    _engine_option("--lora-modules", str, None,
                   "adapters served from the start: name=path pairs separated by spaces or commas, or vLLM's "
                   "JSON ('[{\"name\": \"sql\", \"path\": \"/adapters/sql\"}]')", helm="lora.modules"),
    _engine_option("--max-loras", int, 1, "distinct LoRA adapters in one step (requests on more wait)",
                   helm="lora.maxLoras"),
    _engine_option("--max-lora-rank", int, 16, "largest LoRA rank accepted (8, 16, 32, 64, 128, 256, 320, 512)",
                   helm="lora.maxLoraRank"),
    _engine_option("--max-cpu-loras", int, None, "LoRA adapters each worker keeps loaded (LRU; default: --max-loras)",
                   helm="lora.maxCpuLoras"),
    _engine_option("--lora-dir", str, None,
                   "the folder every served adapter path must lie in (a relative path is taken inside it); "
                   "required for loading adapters at run time", helm="lora.dir"),
    _engine_option("--allow-runtime-lora-updating", bool, False,
                   "allow /v1/load_lora_adapter and /v1/unload_lora_adapter (the gateway also needs --api-key)",
                   helm="lora.allowRuntimeUpdating"),
    _engine_option("--batch-invariant", bool, False,
                   "batch-invariant numerics: every token's logits bitwise independent of the batch and of "
                   "prefill vs decode (CPU; slower)"),
    _engine_option("--enforce-eager", bool, False,
                   "run every step eagerly: no CUDA graphs of decode steps (graphs are CUDA only, never with "
                   "--batch-invariant)"),
    _engine_option("--cuda-graph-sizes", str, None,
                   "decode batch sizes captured as CUDA graphs, comma-separated, e.g. 1,2,4,8,16 (default: 1, 2, "
                   "4, 8 and multiples of 8 up to min(512, --max-num-seqs)); a batch is padded to the next size"),
]


def env_name(flag: str) -> str:
    return envs.flag_env_name(flag)


def add_server_arguments(parser: argparse.ArgumentParser, default_port: Optional[int] = None) -> None:
    add_option(parser, "--host", default="127.0.0.1", help="bind address")
    add_option(parser, "--port", type=int, default=default_port, help="gRPC port")
    add_option(parser, "--grace-period", type=float, default=10.0, help="seconds in-flight requests get on SIGTERM")
    add_option(parser, "--health-port", type=int, default=None,
               help="also serve grpc.health.v1 alone, in plaintext, on this port (for Kubernetes' probes, "
                    "which cannot speak TLS; default: off)")
    add_tls_arguments(parser)


def add_tls_arguments(parser: argparse.ArgumentParser) -> None:
    """``--tls-cert-file`` / ``--tls-key-file`` / ``--tls-ca-file``: mutual TLS on every gRPC link;
    ``--tls-deployment`` / ``--tls-trust-domain``: the deployment the peers' certificates must name."""
    helps = ("this role's certificate (PEM): with the key and the CA, mutual TLS on every gRPC link and "
             "per-RPC authorization by role", "its private key (PEM)",
             "the CA that signs every role's certificate (PEM)")
    for flag, text in zip(("--tls-cert-file", "--tls-key-file", "--tls-ca-file"), helps):
        add_option(parser, flag, help=text)
    add_option(parser, "--tls-deployment",
               help="accept only peer certificates of this deployment (a DNS name; Helm: <fullname>.<namespace>): "
                    "DNS SAN <role>[-<id>].<deployment>.gridserve.internal or SPIFFE URI "
                    "spiffe://<trust domain>/ns/<namespace>/sa/<fullname>-<role>[-<id>] (default: any role name "
                    "the CA signed)")
    add_option(parser, "--tls-trust-domain",
               help="with --tls-deployment: the SPIFFE trust domain a peer's URI must be in (default: any)")


def add_observability_arguments(parser: argparse.ArgumentParser, metrics_port: bool = True) -> None:
    """``--metrics-port`` (Prometheus ``/metrics``; off unless given), ``--otlp-traces-endpoint``
    (OpenTelemetry traces over OTLP/gRPC; off unless given) and ``--log-format``."""
    if metrics_port:
        add_option(parser, "--metrics-port", type=int, default=None,
                   help="serve Prometheus /metrics on this port (0: a free one; default: off)")
    add_option(parser, "--otlp-traces-endpoint",
               help="export OpenTelemetry traces to this OTLP/gRPC endpoint, e.g. http://127.0.0.1:4317 "
                    "(default: off)")
    add_option(parser, "--log-format", choices=("text", "json"), default="text",
               help="log lines as text or one JSON object per line")


def observability_argv(args: argparse.Namespace) -> list[str]:
    """The tracing and log flags of ``args`` again (``serve`` passes them to every role)."""
    argv = ["--log-format", args.log_format]
    if args.otlp_traces_endpoint:
        argv += ["--otlp-traces-endpoint", args.otlp_traces_endpoint]
    return argv


def _add_engine_option(parser: argparse.ArgumentParser, option: EngineOption) -> None:
    flags = [option.flag, option.short] if option.short else [option.flag]
    if option.kind is bool:
        add_option(parser, *flags, action="store_true", default=option.default, help=option.help)
    else:
        add_option(parser, *flags, type=option.kind, default=option.default, help=option.help)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    for option in ENGINE_OPTIONS:
        _add_engine_option(parser, option)


def add_batch_invariant_argument(parser: argparse.ArgumentParser) -> None:
    """``--batch-invariant`` alone (the worker's parser): a token's logits bitwise independent of the
    batch and of prefill vs decode, so seeded sampling gives the same tokens in any batch mix."""
    _add_engine_option(parser, next(o for o in ENGINE_OPTIONS if o.flag == "--batch-invariant"))


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine options of ``args`` as flags again (the launcher forwards them)."""
    argv = []
    for option in ENGINE_OPTIONS:
        value = getattr(args, option.dest)
        if option.kind is bool:
            argv += [option.flag] if value else []
        elif value is not None:
            argv += [option.flag, str(value)]
    return argv


def check_parallel_sizes(args: argparse.Namespace) -> None:
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        value = getattr(args, name)
        if value < 1:
            raise ConfigError(f"parallel.{name}", f"must be a positive integer, got {value}")


def engine_config(args: argparse.Namespace, worker_addresses: list[str]):
    """The engine's ``GridserveConfig`` from its options (model resolved); an option left unset
    (None) keeps the config's own default."""
    from gridserve.shared.config import GridserveConfig

    check_parallel_sizes(args)
    kwargs = {option.config: option.config_value(getattr(args, option.dest))
              for option in ENGINE_OPTIONS if option.config and getattr(args, option.dest) is not None}
    return GridserveConfig.from_kwargs(model=args.model, worker_addresses=worker_addresses, **kwargs).finalize()


def require(value: Optional[str], flag: str, what: str) -> str:
    if not value:
        raise ConfigError(flag.lstrip("-"), f"{what} is required: pass {flag} or set {env_name(flag)}")
    return value


def add_routing_argument(parser: argparse.ArgumentParser) -> None:
    """``--routing-policy`` (``gridserve gateway`` and ``gridserve serve``): how a gateway picks the
    engine of a request with data parallelism (``services/gateway/router.py``)."""
    from gridserve.services.gateway.router import ROUTING_POLICIES

    add_option(parser, "--routing-policy", choices=ROUTING_POLICIES, default="load",
               help="how a gateway picks an engine (DP > 1): load (the least loaded) or prefix (the one "
                    "holding the longest cached prefix of the prompt, unless its load is too far above the "
                    "least loaded one's)")


def routing_argv(args: argparse.Namespace) -> list[str]:
    """``--routing-policy`` of ``args`` as a ``gridserve gateway`` flag (``serve`` passes it on)."""
    return [] if args.routing_policy == "load" else ["--routing-policy", args.routing_policy]
