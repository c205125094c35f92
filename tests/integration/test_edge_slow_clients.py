"""The edge under slow clients (slowloris) and cross-origin browsers (CORS), against a real deployment.

One deployment (worker, engine, gateway, real Envoy on loopback) with a short headers timeout and
one allowed origin. The slowloris client is ``gridserve bench slowloris``'s; the browser is the
system Chromium driven by Playwright (tests/integration/browser.py).
"""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator

import pytest

from gridserve.benchmarks.slowloris import SlowClients, probe
from gridserve.edge import CorsPolicy, EdgeLimits
from gridserve.launcher import free_port

from .browser import launch
from .services import deployment

pytestmark = pytest.mark.slow

HEADERS_TIMEOUT_S = 2.0
SLOW_CLIENTS = 48
PAGE = b"<!doctype html><html><head><title>another origin</title></head><body>app</body></html>"


@pytest.fixture(scope="module")
def page_port() -> Iterator[int]:
    """A web page on its own loopback port: another origin than the edge's."""
    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server name
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(PAGE)))
            self.end_headers()
            self.wfile.write(PAGE)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), Page)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def edge(llama_tiny, tmp_path_factory, page_port):
    cors = CorsPolicy((f"http://127.0.0.1:{page_port}",))
    with deployment(llama_tiny, tmp_path_factory.mktemp("logs"), edge_port=free_port(),
                    edge_limits=EdgeLimits(request_headers_timeout_s=HEADERS_TIMEOUT_S), edge_cors=cors) as launcher:
        yield launcher


def _host_port(launcher) -> tuple[str, int]:
    host, port = launcher.edge_address.rsplit(":", 1)
    return host, int(port)


def test_the_edge_answers_a_probe_while_slow_clients_hold_connections_and_cuts_them(edge):
    host, port = _host_port(edge)
    with SlowClients(host, port, SLOW_CLIENTS, byte_interval_s=0.2) as slow:
        assert slow.wait_open(30), f"{slow.open_now} of {SLOW_CLIENTS} slow connections open"
        latencies, statuses = probe(host, port, "/health", time.monotonic() + 3, interval_s=0.05)
        assert statuses and set(statuses) == {200}, statuses  # every probe answered while they are held
        assert max(latencies) < 10  # generous: no probe waits behind the slow clients
        deadline = time.monotonic() + 30
        while len(slow.cuts) < SLOW_CLIENTS and time.monotonic() < deadline:
            time.sleep(0.2)
        cuts = list(slow.cuts)
    # Every slow connection of the first wave was cut by the headers timeout (a 408), not left open.
    assert len(cuts) >= SLOW_CLIENTS, f"only {len(cuts)} slow connections cut"
    assert {how for _, how in cuts} == {"408"}, cuts
    assert all(HEADERS_TIMEOUT_S * 0.5 <= lived < HEADERS_TIMEOUT_S + 10 for lived, _ in cuts), cuts


@pytest.fixture(scope="module")
def browser():
    yield from launch()


_FETCH = """async (edge) => {
  try {
    const models = await fetch(edge + "/v1/models", {headers: {"Authorization": "Bearer none"}});
    const completion = await fetch(edge + "/v1/completions", {method: "POST",
      headers: {"Content-Type": "application/json"},
      body: JSON.stringify({prompt: [5, 17, 300], max_tokens: 1, temperature: 0})});
    return {models: models.status, ids: (await models.json()).data.map(m => m.id),
            completion: completion.status, text: (await completion.json()).choices.length};
  } catch (error) {
    return {error: String(error)};
  }
}"""


def _fetch_from(browser, page_url: str, edge_url: str) -> dict:
    context = browser.new_context()
    try:
        page = context.new_page()
        page.goto(page_url)
        return page.evaluate(_FETCH, edge_url)
    finally:
        context.close()


def test_a_page_of_an_allowed_origin_calls_the_api_and_another_origin_cannot(edge, browser, page_port):
    edge_url = f"http://{edge.edge_address}"
    allowed = _fetch_from(browser, f"http://127.0.0.1:{page_port}/", edge_url)
    assert allowed.get("models") == 200 and allowed.get("completion") == 200, allowed
    assert len(allowed["ids"]) == 1 and allowed["text"] == 1
    # The same page from another origin (localhost is not 127.0.0.1 to a browser): the preflight
    # gets no Access-Control-Allow-Origin, so the browser refuses the call.
    other = _fetch_from(browser, f"http://localhost:{page_port}/", edge_url)
    assert "error" in other and "Failed to fetch" in other["error"], other
