"""gRPC metadata keys that are part of a contract between roles (and with the Envoy edge)."""

from __future__ import annotations

# The gateway sends it as initial metadata; the edge's Lua filter turns it into the HTTP status of
# the transcoded response (and removes it).
HTTP_STATUS_HEADER = "x-gridserve-http-status"
