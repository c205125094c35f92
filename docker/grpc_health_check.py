"""Container health check: exit 0 when the local gRPC server reports SERVING (grpc.health.v1).

Used by the images' HEALTHCHECK (Docker, Podman). Kubernetes uses its native gRPC probes instead.
The port comes from the first argument, else GRIDSERVE_HEALTH_PORT (the plaintext health-only port,
which a role with mutual TLS must have for this check), else GRIDSERVE_PORT (set in each image).
"""

from __future__ import annotations

import os
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main() -> int:
    port = (sys.argv[1] if len(sys.argv) > 1 else
            os.environ.get("GRIDSERVE_HEALTH_PORT") or os.environ.get("GRIDSERVE_PORT", ""))
    if not port:
        print("grpc_health_check: no port (set GRIDSERVE_PORT or pass one)", file=sys.stderr)
        return 2
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
        except grpc.RpcError as exc:
            print(f"grpc_health_check: {exc.code().name}", file=sys.stderr)
            return 1
    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
    if not serving:
        print(f"grpc_health_check: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}",
              file=sys.stderr)
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
