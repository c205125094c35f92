"""Stream a completion from a gridserve gateway with the generated Python stubs.

    gridserve serve                      # the Envoy edge on :8000 takes native gRPC too
    python examples/grpc_client.py 127.0.0.1:8000 "def fibonacci(n):"

    gridserve serve --tls                # prints the edge's CA file
    python examples/grpc_client.py 127.0.0.1:8000 --ca-file /tmp/gridserve-tls-XXXX/ca.crt

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
    parser.add_argument("address", help="the edge's (or a gateway's) host:port")
    parser.add_argument("prompt", nargs="?", default="def fibonacci(n):")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--ca-file", help="TLS: the CA that signed the server's certificate (PEM)")
    parser.add_argument("--cert-file", help="TLS: a client certificate (PEM), for a gateway's mutual TLS")
    parser.add_argument("--key-file", help="TLS: the key of --cert-file (PEM)")
    args = parser.parse_args()

    request = gateway_pb2.GenerateRequest(
        text=args.prompt,
        sampling_params=common_pb2.SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens),
    )
    if args.ca_file:
        def read(path):
            with open(path, "rb") as f:
                return f.read()

        credentials = grpc.ssl_channel_credentials(
            root_certificates=read(args.ca_file),
            private_key=read(args.key_file) if args.key_file else None,
            certificate_chain=read(args.cert_file) if args.cert_file else None)
        channel = grpc.secure_channel(args.address, credentials)
    else:
        channel = grpc.insecure_channel(args.address)
    with channel:
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
