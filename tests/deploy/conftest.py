"""Fixtures of the deployment tests: a helm binary and the chart rendered per value set."""

from __future__ import annotations

import hashlib
import json
import subprocess
from typing import Any

import pytest

from tests.missing_tool import missing

from .tools import Rendered, find_helm, render


@pytest.fixture(scope="session")
def helm() -> str:
    try:
        return find_helm()
    except (RuntimeError, OSError, subprocess.SubprocessError, StopIteration, KeyError) as exc:
        reason = f"helm is not available and could not be fetched: {exc}"
        print(reason)
        missing(reason)


@pytest.fixture(scope="session")
def render_chart(helm: str):
    """``render_chart(values)``: the rendered objects, cached per value set for the session."""
    cache: dict[str, Rendered] = {}

    def _render(values: dict[str, Any] | None = None) -> Rendered:
        key = hashlib.sha256(json.dumps(values or {}, sort_keys=True).encode()).hexdigest()
        if key not in cache:
            cache[key] = render(helm, values)
        return cache[key]

    return _render
