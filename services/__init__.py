"""The gridserve roles, one package each: gateway, engine, worker (and coordinator later)."""
