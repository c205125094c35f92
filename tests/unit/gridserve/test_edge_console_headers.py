"""The edge answers the web console with its security headers (issue 38): a Content-Security-Policy
allowing only same-origin scripts, styles and fetches and no framing, nosniff, no referrer; the API
routes are left as they were. (Through a real Envoy: tests/integration/test_safe_defaults.py.)"""

from __future__ import annotations

from gridserve.edge import CONSOLE_HEADERS, GATEWAY_SERVICE, envoy_config


def _routes() -> list[dict]:
    config = envoy_config("127.0.0.1", 18000, ["127.0.0.1:50050"], descriptor_set=__file__)
    (listener,) = config["static_resources"]["listeners"]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    return manager["route_config"]["virtual_hosts"][0]["routes"]


def test_the_console_route_adds_its_security_headers_and_no_other_route_does():
    added = {route["match"].get("path"): route.get("response_headers_to_add") for route in _routes()}
    console = {h["header"]["key"]: h["header"]["value"] for h in added.pop(f"/{GATEWAY_SERVICE}/GetConsoleFile")}
    assert console == CONSOLE_HEADERS
    policy = console["content-security-policy"]
    for directive in ("default-src 'none'", "script-src 'self'", "style-src 'self'", "connect-src 'self'",
                      "frame-ancestors 'none'", "base-uri 'none'"):
        assert directive in policy
    assert console["x-content-type-options"] == "nosniff" and console["x-frame-options"] == "DENY"
    assert not any(added.values())
