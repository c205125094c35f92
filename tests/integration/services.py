"""Helpers of the service tests: a local deployment (real processes on loopback) and stubs."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

import grpc

from gridserve.api.common.v1 import common_pb2
from gridserve.api.engine.v1 import engine_pb2_grpc
from gridserve.api.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from gridserve.launcher import Launcher

KV_BYTES = 32 << 20
ENGINE_ARGS = ["--kv-cache-memory-bytes", str(KV_BYTES), "--max-num-seqs", "128"]


@contextlib.contextmanager
def deployment(model: Path, log_dir: Path, grace_s: float = 5.0, edge_port: Optional[int] = None,
               api_server_count: int = 1, engine_args: Optional[list[str]] = None,
               **launcher_kwargs) -> Iterator[Launcher]:
    """Worker, engine and gateway processes (and the Envoy edge on ``edge_port`` if given); always
    stopped (process groups killed) on exit. Other keywords go to ``Launcher`` (``api_key``, ...)."""
    launcher = Launcher(str(model), ENGINE_ARGS if engine_args is None else engine_args, log_dir=log_dir,
                        grace_s=grace_s, edge_port=edge_port, api_server_count=api_server_count,
                        **launcher_kwargs)
    try:
        launcher.start()
        yield launcher
    except Exception:
        # printed, not logged: a logging handler left by an earlier test may hold a closed stream
        for log in sorted(log_dir.glob("*.log")):
            print(f"---- {log.name}\n{log.read_text(errors='replace')[-4000:]}", file=sys.stderr)
        raise
    finally:
        launcher.stop()


def address(launcher: Launcher, role: str) -> str:
    return next(p.address for p in launcher.processes if p.role == role)


def pid(launcher: Launcher, role: str) -> int:
    return next(p.pid for p in launcher.processes if p.role == role)


def gateway_stub(channel: grpc.Channel) -> gateway_pb2_grpc.GatewayStub:
    return gateway_pb2_grpc.GatewayStub(channel)


def engine_stub(channel: grpc.Channel) -> engine_pb2_grpc.EngineCoreStub:
    return engine_pb2_grpc.EngineCoreStub(channel)


def greedy(max_tokens: int, **kwargs) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, **kwargs)


def token_prompt(ids: list[int], params: common_pb2.SamplingParams) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(token_ids=gateway_pb2.TokenIds(ids=ids), sampling_params=params)


def stream_tokens(stub: gateway_pb2_grpc.GatewayStub, request: gateway_pb2.GenerateRequest,
                  timeout: float = 60) -> tuple[list[int], str, int]:
    """Token ids, text and finish reason of one streamed generation."""
    ids, text, reason = [], "", 0
    for response in stub.Generate(request, timeout=timeout):
        ids += response.token_ids
        text += response.text
        reason = response.finish_reason or reason
    return ids, text, reason
