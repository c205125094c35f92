"""Command-line options of the three roles, shared by ``gridserve worker|engine|gateway|serve``.

Every option can also come from a ``GRIDSERVE_<OPTION>`` environment variable (e.g.
``GRIDSERVE_WORKERS``, ``GRIDSERVE_MODEL``); a flag wins over the variable. A role started without
a required address fails at once with a message that names the flag and the variable.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any, Optional

from gridserve.shared.errors import ConfigError

logger = logging.getLogger(__name__)

# Engine options: (flag, type, default, help). ``gridserve serve`` forwards them to its engine.
ENGINE_OPTIONS: list[tuple[str, Any, Any, str]] = [
    ("--dtype", str, "auto", "weight dtype (auto, float32, float16, bfloat16)"),
    ("--max-model-len", int, None, "maximum tokens per sequence (default: the model's)"),
    ("--max-num-seqs", int, 256, "sequence cap per step"),
    ("--max-num-batched-tokens", int, None, "token budget per step"),
    ("--max-waiting-requests", int, None,
     "admission control: refuse new requests (RESOURCE_EXHAUSTED; HTTP 429 when every engine is full) "
     "while this many wait (default: unbounded)"),
    ("--block-size", int, 16, "tokens per KV block"),
    ("--kv-cache-memory-bytes", int, None, "KV-cache budget in bytes (default: profiled / 2 GiB on CPU)"),
    ("--kv-cache-dtype", str, "auto",
     "KV-cache storage dtype (auto, bfloat16, float16, fp8_e4m3, fp8_e5m2; fp8 with per-tensor scales)"),
    ("--quantization", str, None, "quantize the weights while they load (int8, int4)"),
    ("--quantization-config", str, None,
     'per-layer quantization as JSON, e.g. {"method": "int8", "ignore": ["lm_head"]}'),
    ("--seed", int, 0, "random seed"),
    ("--device", str, "auto", "worker device (auto, cpu, cuda)"),
    ("--tensor-parallel-size", int, 1, "tensor-parallel workers per pipeline stage (-tp)"),
    ("--pipeline-parallel-size", int, 1, "pipeline stages per engine (-pp)"),
    ("--distributed-init-address", str, None,
     "host:port of the workers' torch.distributed rendezvous (default: a free loopback port)"),
    ("--distributed-executor-backend", str, "grpc",
     "how the engine reaches its workers: grpc (worker services at --workers) or ray (Ray places and "
     "starts them as actors; RAY_ADDRESS or a local Ray)"),
    ("--worker-extension-cls", str, None,
     "module:Class mixed into every worker; its public methods are callable through CollectiveRpc"),
    ("--worker-recovery-timeout", float, 120.0,
     "seconds a failed worker group may take to come back before in-flight requests fail "
     "(0: a worker failure kills the engine)"),
]


def env_name(flag: str) -> str:
    return "GRIDSERVE_" + flag.lstrip("-").replace("-", "_").upper()


def env_default(flag: str, default: Any = None, kind: Any = str) -> Any:
    value = os.environ.get(env_name(flag))
    if value is None or value == "":
        return default
    return kind(value)


def add_server_arguments(parser: argparse.ArgumentParser, default_port: Optional[int] = None) -> None:
    parser.add_argument("--host", default=env_default("--host", "127.0.0.1"), help="bind address [GRIDSERVE_HOST]")
    parser.add_argument("--port", type=int, default=env_default("--port", default_port, int),
                        help="gRPC port [GRIDSERVE_PORT]")
    parser.add_argument("--grace-period", type=float, default=env_default("--grace-period", 10.0, float),
                        help="seconds in-flight requests get on SIGTERM [GRIDSERVE_GRACE_PERIOD]")
    parser.add_argument("--health-port", type=int, default=env_default("--health-port", None, int),
                        help="also serve grpc.health.v1 alone, in plaintext, on this port (for Kubernetes' "
                             "probes, which cannot speak TLS; default: off) [GRIDSERVE_HEALTH_PORT]")
    add_tls_arguments(parser)


def add_tls_arguments(parser: argparse.ArgumentParser) -> None:
    """``--tls-cert-file`` / ``--tls-key-file`` / ``--tls-ca-file``: mutual TLS on every gRPC link."""
    helps = ("this role's certificate (PEM): with the key and the CA, mutual TLS on every gRPC link and "
             "per-RPC authorization by role", "its private key (PEM)",
             "the CA that signs every role's certificate (PEM)")
    for flag, text in zip(("--tls-cert-file", "--tls-key-file", "--tls-ca-file"), helps):
        parser.add_argument(flag, default=env_default(flag), help=f"{text} [{env_name(flag)}]")


def add_observability_arguments(parser: argparse.ArgumentParser, metrics_port: bool = True) -> None:
    """``--metrics-port`` (Prometheus ``/metrics``; off unless given), ``--otlp-traces-endpoint``
    (OpenTelemetry traces over OTLP/gRPC; off unless given) and ``--log-format``."""
    if metrics_port:
        parser.add_argument("--metrics-port", type=int, default=env_default("--metrics-port", None, int),
                            help="serve Prometheus /metrics on this port (0: a free one; default: off) "
                                 "[GRIDSERVE_METRICS_PORT]")
    parser.add_argument("--otlp-traces-endpoint", default=env_default("--otlp-traces-endpoint"),
                        help="export OpenTelemetry traces to this OTLP/gRPC endpoint, e.g. "
                             "http://127.0.0.1:4317 (default: off) [GRIDSERVE_OTLP_TRACES_ENDPOINT]")
    parser.add_argument("--log-format", choices=("text", "json"), default=env_default("--log-format", "text"),
                        help="log lines as text or one JSON object per line [GRIDSERVE_LOG_FORMAT]")


def observability_argv(args: argparse.Namespace) -> list[str]:
    """The tracing and log flags of ``args`` again (``serve`` passes them to every role)."""
    argv = ["--log-format", args.log_format]
    if args.otlp_traces_endpoint:
        argv += ["--otlp-traces-endpoint", args.otlp_traces_endpoint]
    return argv


_SHORT_FLAGS = {"--tensor-parallel-size": "-tp", "--pipeline-parallel-size": "-pp"}


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    for flag, kind, default, help_text in ENGINE_OPTIONS:
        flags = [flag, _SHORT_FLAGS[flag]] if flag in _SHORT_FLAGS else [flag]
        parser.add_argument(*flags, type=kind, default=env_default(flag, default, kind),
                            help=f"{help_text} [{env_name(flag)}]")
    parser.add_argument("--no-prefix-caching", action="store_true",
                        default=bool(env_default("--no-prefix-caching", "")), help="disable prefix caching")
    add_batch_invariant_argument(parser)


def add_batch_invariant_argument(parser: argparse.ArgumentParser) -> None:
    """``--batch-invariant`` (engine, ``serve``, worker): a token's logits bitwise independent of the
    batch and of prefill vs decode, so seeded sampling gives the same tokens in any batch mix."""
    from gridserve.shared.config import batch_invariant_from_env

    parser.add_argument("--batch-invariant", action="store_true", default=batch_invariant_from_env(),
                        help="batch-invariant numerics: every token's logits bitwise independent of the "
                             "batch and of prefill vs decode (CPU; slower) [GRIDSERVE_BATCH_INVARIANT=1]")


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine options of ``args`` as flags again (the launcher forwards them)."""
    argv = []
    for flag, _, _, _ in ENGINE_OPTIONS:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            argv += [flag, str(value)]
    if args.no_prefix_caching:
        argv.append("--no-prefix-caching")
    if args.batch_invariant:
        argv.append("--batch-invariant")
    return argv


def check_parallel_sizes(args: argparse.Namespace) -> None:
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        value = getattr(args, name)
        if value < 1:
            raise ConfigError(f"parallel.{name}", f"must be a positive integer, got {value}")


def engine_config(args: argparse.Namespace, worker_addresses: list[str]):
    """The engine's ``GridserveConfig`` from its options (model resolved)."""
    from gridserve.shared.config import GridserveConfig

    check_parallel_sizes(args)
    return GridserveConfig.from_kwargs(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_waiting_requests=args.max_waiting_requests,
        block_size=args.block_size,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        quantization_config=args.quantization_config or {},
        seed=args.seed,
        device=args.device,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        distributed_init_address=args.distributed_init_address or "",
        worker_extension_cls=args.worker_extension_cls or "",
        enable_prefix_caching=not args.no_prefix_caching,
        batch_invariant=args.batch_invariant,
        distributed_executor_backend=args.distributed_executor_backend,
        worker_addresses=worker_addresses,
    ).finalize()


def require(value: Optional[str], flag: str, what: str) -> str:
    if not value:
        raise ConfigError(flag.lstrip("-"), f"{what} is required: pass {flag} or set {env_name(flag)}")
    return value
