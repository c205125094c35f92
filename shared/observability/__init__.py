"""Observability every role shares: Prometheus metrics over HTTP, OpenTelemetry traces with W3C
trace context, and text or JSON log lines. Nothing here imports torch; OpenTelemetry is imported
only when tracing is switched on."""
