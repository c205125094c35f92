"""The engine core: scheduler, KV-cache manager and the busy loop that drives the executor. No torch."""
