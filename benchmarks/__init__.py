"""Benchmarks, one package: `gridserve bench <name>` (see ``COMMANDS`` in ``gridserve.cli``) and the
scripts run as ``python -m gridserve.benchmarks.<script>``; results and sweep scripts live beside them
in ``benchmarks/``."""
