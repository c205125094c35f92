"""A headless Chromium driven by Playwright, for the web console's tests.

The browser is Debian's ``chromium`` package (``make test``'s set-up installs it where it runs as
root on Debian), never one Playwright downloads. Without it the browser tests are skipped with the
reason, except under ``CI=true``, where a missing browser fails them: CI must run them.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.missing_tool import missing

CHROMIUM = "/usr/bin/chromium"  # GRIDSERVE_CHROMIUM names another binary
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]


def _missing(reason: str) -> None:
    missing(reason)  # fails under CI=true: the browser tests must run in CI


def chromium_path() -> str:
    """The Chromium binary, or skip (fail under CI=true) saying why it is missing."""
    path = os.environ.get("GRIDSERVE_CHROMIUM", CHROMIUM)
    if Path(path).exists():
        return path
    found = None if "GRIDSERVE_CHROMIUM" in os.environ else shutil.which("chromium")
    if found is None:
        _missing(f"no Chromium at {path} (install it: apt-get install -y chromium, "
                 "or `make test` as root on Debian)")
    return found


def launch() -> Iterator[Any]:
    """A Playwright ``Browser`` on the system Chromium (a generator for a pytest fixture)."""
    path = chromium_path()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _missing("the playwright package is not installed (pip install playwright; the test extra has it)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=path, args=ARGS, headless=True)
        try:
            yield browser
        finally:
            browser.close()
