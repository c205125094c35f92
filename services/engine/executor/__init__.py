"""Executors: how the engine reaches its workers (in-process, or gRPC services)."""

from gridserve.services.engine.executor.base import WORKER_METHODS, Executor, check_worker_method

__all__ = ["Executor", "WORKER_METHODS", "check_worker_method"]
