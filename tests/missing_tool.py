"""The one rule for a test whose tool is missing (buf, Envoy, a C++ compiler, Chromium, helm):
skipped with the reason on a developer's machine, failed under ``CI=true`` — CI must run it."""

from __future__ import annotations

import os

import pytest


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() == "true"


def missing(reason: str) -> None:
    """Skip saying ``reason``, or fail under ``CI=true``."""
    if in_ci():
        pytest.fail(f"CI=true and {reason}: this test must run in CI", pytrace=False)
    pytest.skip(reason)


def require(available: bool, reason: str) -> None:
    if not available:
        missing(reason)
