"""A missing tool skips a test on a developer's machine and fails it under ``CI=true``."""

from __future__ import annotations

import pytest

from tests.missing_tool import missing, require


def test_a_missing_tool_skips_outside_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="no buf"):
        missing("no buf")


def test_a_missing_tool_fails_under_ci(monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true and envoy is not installed"):
        require(False, "envoy is not installed")
    require(True, "never said")  # a present tool neither skips nor fails
