"""gRPC plumbing every role shares: server bootstrap, health, the error interceptor, client
helpers, and the proto <-> domain conversions of the engine and worker contracts."""
