"""The data-parallel coordinator role: engines report their load, gateways watch it."""
