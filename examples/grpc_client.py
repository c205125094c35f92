"""Stream a completion from a gridserve gateway with the generated Python stubs.

    gridserve serve                      # prints the gateway's gRPC address
    python examples/grpc_client.py 127.0.0.1:PORT "def fibonacci(n):"

The stubs are generated at install time (``python -m gridserve.protos_build``).
"""

from __future__ import annotations

import argparse
import sys

import grpc

from gridserve.api.common.v1 import common_pb2
from gridserve.api.gateway.v1 import gateway_pb2, gateway_pb2_grpc


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("address", help="gateway host:port")
    parser.add_argument("prompt", nargs="?", default="def fibonacci(n):")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()

    request = gateway_pb2.GenerateRequest(
        text=args.prompt,
        sampling_params=common_pb2.SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens),
    )
    with grpc.insecure_channel(args.address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        sys.stdout.write(args.prompt)
        for response in stub.Generate(request, timeout=60):
            sys.stdout.write(response.text)
            sys.stdout.flush()
            if response.finish_reason:
                reason = common_pb2.FinishReason.Name(response.finish_reason)
                print(f"\n[{reason}, {response.usage.completion_tokens} tokens]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
