"""The web console's parts that need no deployment: its files, the status token rate, and the
browser tests' rule for a missing browser (skip, but fail under CI=true)."""

from __future__ import annotations

import re

import pytest

from gridserve.services.gateway.auth import OPEN_METHODS
from gridserve.services.gateway.console import STATIC_DIR, Console
from gridserve.services.gateway.status import TokenRate
from tests.integration.browser import chromium_path


def test_console_serves_index_for_empty_name_and_404_for_unknown_files():
    console = Console()
    index = console.get("")
    assert index.status == 200 and index.content_type.startswith("text/html")
    assert console.get("index.html") == index
    assert console.get("chat.js").content_type.startswith("text/javascript")
    assert console.get("../setup.py").status == 404
    assert console.get("nope.js").status == 404


def test_console_page_loads_only_files_the_gateway_serves_and_nothing_external():
    console = Console()
    html = console.get("").body.decode()
    for src in re.findall(r'(?:src|href)="([^"]+)"', html):
        if src.startswith("#") or src.startswith("data:"):
            continue
        assert src.startswith("/console/"), src
        assert console.get(src.removeprefix("/console/")).status == 200, src
    for path in STATIC_DIR.iterdir():
        assert "http://" not in path.read_text() and "https://" not in path.read_text(), path.name


def test_console_files_need_no_api_key_but_status_does():
    assert "/gridserve.gateway.v1.Gateway/GetConsoleFile" in OPEN_METHODS
    assert "/gridserve.gateway.v1.Gateway/GetStatus" not in OPEN_METHODS


def test_token_rate_is_zero_first_then_averages_over_the_window():
    rate = TokenRate(window_s=5.0)
    assert rate.update(100.0, 0) == 0.0
    assert rate.update(101.0, 50) == pytest.approx(50.0)
    assert rate.update(102.0, 150) == pytest.approx(75.0)  # 150 tokens over 2 s
    for t in range(3, 20):
        rate.update(100.0 + t, 150 + 10 * (t - 2))
    assert rate.update(120.0, 330) == pytest.approx(10.0)  # old samples left the window


def test_token_rate_starts_over_when_the_counter_goes_down():
    rate = TokenRate()
    rate.update(0.0, 1000)
    assert rate.update(1.0, 10) == 0.0  # a restarted engine
    assert rate.update(2.0, 30) == pytest.approx(20.0)


def test_missing_browser_skips_with_the_reason(monkeypatch, tmp_path):
    monkeypatch.setenv("GRIDSERVE_CHROMIUM", str(tmp_path / "no-chromium"))
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="apt-get install -y chromium"):
        chromium_path()


def test_missing_browser_fails_under_ci(monkeypatch, tmp_path):
    monkeypatch.setenv("GRIDSERVE_CHROMIUM", str(tmp_path / "no-chromium"))
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true"):
        chromium_path()
