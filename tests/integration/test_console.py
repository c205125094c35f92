"""The web console in a real browser (headless Chromium, Playwright) against a real deployment:
worker, engine, gateway and the Envoy edge on free loopback ports, serving the recipe's tiny Llama.

The page is served by the edge at ``/``; the chat streams from ``/v1/chat/completions`` and the
status page polls ``/v1/status``. ``GRIDSERVE_CONSOLE_SCREENSHOTS=DIR`` saves screenshots of the
chat and the status page there (``docs/console.png`` is taken that way, with
``GRIDSERVE_CONSOLE_MODEL`` naming the default model's GGUF (``python -c "from gridserve.default_model
import default_model_file as f; print(f())"``) instead of the tiny Llama).
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from gridserve.api.engine.v1 import engine_pb2
from gridserve.api.gateway.v1 import gateway_pb2
from gridserve.default_model import DEFAULT_MODEL_NAME
from gridserve.launcher import free_port
from gridserve.services.gateway.status import CACHE_S as STATUS_CACHE_S

from .browser import launch
from .services import ENGINE_ARGS, address, deployment, engine_stub, gateway_stub, pid

pytestmark = pytest.mark.slow

TIMEOUT_MS = 60_000
# Long enough to still be streaming when the test cancels (the tiny Llama's context is 512).
LONG_ANSWER_TOKENS = 450
# The question the chat box opens with (services/gateway/static/index.html).
EXAMPLE_QUESTION = "What is the capital of France? Answer in one sentence."


def served_name(model: Path) -> str:
    return DEFAULT_MODEL_NAME if model.suffix == ".gguf" else model.name


@pytest.fixture(scope="module")
def browser():
    yield from launch()


@pytest.fixture(scope="module")
def model(llama_tiny) -> Path:
    return Path(os.environ.get("GRIDSERVE_CONSOLE_MODEL") or llama_tiny)


@pytest.fixture(scope="module")
def edge(model, tmp_path_factory):
    # a real model's context (8k) needs more KV memory than the tests give: shorten it
    engine_args = [*ENGINE_ARGS, "--max-model-len", "512"] if model.suffix == ".gguf" else None
    with deployment(model, tmp_path_factory.mktemp("logs"), edge_port=free_port(),
                    served_model_name=served_name(model), engine_args=engine_args) as launcher:
        yield launcher


@pytest.fixture
def page(browser, edge):
    context = browser.new_context(viewport={"width": 1100, "height": 760})
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    page.goto(f"http://{edge.edge_address}/")
    yield page
    context.close()


def _wait_for(page, expression: str, timeout_s: float = TIMEOUT_MS / 1000) -> None:
    """Poll ``expression`` from here until it is true: Playwright's ``wait_for_function`` polls with
    ``eval`` inside the page, which the console's Content-Security-Policy (no 'unsafe-eval') refuses."""
    deadline = time.monotonic() + timeout_s
    while not page.evaluate(expression):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{expression} stayed false for {timeout_s:g} s")
        time.sleep(0.05)


def _running(launcher) -> int:
    with grpc.insecure_channel(address(launcher, "engine")) as channel:
        return engine_stub(channel).GetLoad(engine_pb2.GetLoadRequest(), timeout=10).num_running


def _ask(page, prompt: str, max_tokens: int, temperature: float = 0.0) -> None:
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#temperature", str(temperature))
    page.fill("#prompt", prompt)
    page.click("#send")


def test_console_page_loads_and_lists_the_served_model(page, model):
    assert page.title() == "gridserve console"
    _wait_for(page, "document.querySelectorAll('#model option').length > 0")
    assert page.eval_on_selector_all("#model option", "os => os.map(o => o.value)") == [served_name(model)]
    assert page.input_value("#prompt") == EXAMPLE_QUESTION  # a real question, ready to send
    assert page.is_visible("#chat") and not page.is_visible("#status")
    assert page.is_hidden("#chat-error")


def test_the_console_runs_under_its_content_security_policy(browser, edge):
    context = browser.new_context()
    page = context.new_page()
    violations = []
    page.on("console", lambda message: violations.append(message.text)
            if "Content Security Policy" in message.text else None)
    response = page.goto(f"http://{edge.edge_address}/")
    assert "frame-ancestors 'none'" in response.headers["content-security-policy"]
    _wait_for(page, "document.querySelectorAll('#model option').length > 0")  # its scripts ran, fetched
    page.click("#nav-status")
    _wait_for(page, "document.querySelectorAll('#roles tbody tr').length > 0")
    context.close()
    assert violations == []


def test_prompt_streams_tokens_into_the_page_incrementally(page, edge):
    _wait_for(page, "document.querySelectorAll('#model option').length > 0")
    _status(edge)  # the token rate's first sample
    # Record the answer's length each time the page changes it (one record per task, so several
    # records mean the text grew across several network reads, not from one buffered body).
    page.evaluate("""() => {
        window.reads = [];
        new MutationObserver(() => {
            const answer = document.querySelector('.message.assistant:last-child .text');
            if (answer) window.reads.push(answer.textContent.length);
        }).observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});
    }""")
    _ask(page, EXAMPLE_QUESTION, max_tokens=64)
    page.wait_for_selector(".message.assistant[data-done='true']")
    _save_screenshot(page, "console.png")
    final = page.inner_text(".message.assistant:last-child .text")
    reads = [n for n in page.evaluate("window.reads") if n > 0]
    assert len(final) > 0 and reads[-1] == len(final)
    growing = sorted(set(reads))
    assert len(growing) >= 2, f"the answer appeared in one piece: {reads}"
    assert growing[0] < len(final)
    assert page.is_hidden("#chat-error")
    assert page.is_enabled("#send") and page.is_disabled("#cancel")
    time.sleep(STATUS_CACHE_S)  # a snapshot serves every caller for this long
    (engine,) = _status(edge)["engines"]
    assert engine["generation_tokens_per_second"] > 0  # the answer's tokens, since the first sample


def test_cancel_aborts_the_stream_and_frees_the_engine(page, edge):
    _wait_for(page, "document.querySelectorAll('#model option').length > 0")
    _ask(page, "Write a very long story.", max_tokens=LONG_ANSWER_TOKENS, temperature=1.0)
    _wait_for(page, "document.querySelector('.message.assistant .text')?.textContent.length > 0")
    assert _running(edge) == 1
    page.click("#cancel")
    page.wait_for_selector(".message.assistant[data-done='true']")
    assert page.get_attribute(".message.assistant:last-child", "data-cancelled") == "true"
    stopped_at = len(page.inner_text(".message.assistant:last-child .text"))
    deadline = time.monotonic() + 10
    while _running(edge) != 0:
        assert time.monotonic() < deadline, "the engine still runs the cancelled request"
        time.sleep(0.1)
    assert len(page.inner_text(".message.assistant:last-child .text")) == stopped_at
    assert page.is_enabled("#send")


def test_with_an_api_key_the_page_loads_and_the_api_needs_the_key_typed_in(browser, llama_tiny, tmp_path):
    with deployment(llama_tiny, tmp_path, edge_port=free_port(), api_key="s3cret") as launcher:
        context = browser.new_context()
        page = context.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        page.goto(f"http://{launcher.edge_address}/")
        page.wait_for_selector("#chat-error:not([hidden])")
        assert "API key" in page.inner_text("#chat-error")
        page.fill("#api-key", "s3cret")
        page.dispatch_event("#api-key", "change")
        _wait_for(page, "document.querySelectorAll('#model option').length > 0")
        assert page.is_hidden("#chat-error")
        page.click("#nav-status")
        page.wait_for_selector("#roles tr[data-name='worker-0.0'][data-health='SERVING']")
        context.close()


def _status(launcher) -> dict:
    with urllib.request.urlopen(f"http://{launcher.edge_address}/v1/status", timeout=10) as response:
        return json.loads(response.read())


def test_status_endpoint_lists_every_role(edge):
    status = _status(edge)
    roles = {r["name"]: r for r in status["roles"]}
    assert set(roles) == {"gateway", "engine-0", "worker-0.0"}
    assert roles["worker-0.0"]["address"] == address(edge, "worker")
    assert roles["engine-0"]["address"] == address(edge, "engine")
    assert all(r["health"] == "SERVING" and r["ready"] for r in roles.values())
    (engine,) = status["engines"]
    assert engine["num_workers"] == 1 and 0.0 <= engine["kv_cache_usage"] <= 1.0


def test_status_lists_the_coordinator_and_each_engines_workers_with_data_parallel(llama_tiny, tmp_path):
    with deployment(llama_tiny, tmp_path, data_parallel_size=2) as launcher:
        with grpc.insecure_channel(address(launcher, "gateway")) as channel:
            status = gateway_stub(channel).GetStatus(gateway_pb2.GetStatusRequest(), timeout=10)
        by_role = {role: {(r.name, r.address) for r in status.roles if r.role == role}
                   for role in ("gateway", "coordinator", "engine", "worker")}
        for role, named in by_role.items():
            addresses = {p.address for p in launcher.processes if p.role == role}
            assert {a for _, a in named} == addresses, role
        assert {n for n, _ in by_role["engine"]} == {"engine-0", "engine-1"}
        assert {n for n, _ in by_role["worker"]} == {"worker-0.0", "worker-1.0"}
        assert all(r.health == "SERVING" and r.ready for r in status.roles)
        assert [e.name for e in status.engines] == ["engine-0", "engine-1"]


def test_status_page_shows_a_killed_worker(browser, model, tmp_path):
    with deployment(model, tmp_path, edge_port=free_port()) as launcher:
        context = browser.new_context(viewport={"width": 1100, "height": 560})
        page = context.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        page.goto(f"http://{launcher.edge_address}/#status")
        names = ["gateway", "engine-0", "worker-0.0"]
        for name in names:
            page.wait_for_selector(f"#roles tr[data-name='{name}'][data-health='SERVING']")
        _save_screenshot(page, "console-status.png")
        os.kill(pid(launcher, "worker"), signal.SIGKILL)
        page.wait_for_selector("#roles tr[data-health='NOT_SERVING']")
        page.wait_for_selector("#roles tr[data-name='worker-0.0'][data-health='UNREACHABLE']")
        health = dict(page.eval_on_selector_all("#roles tr", "rows => rows.map(r => [r.dataset.name, r.dataset.health])"))
        # The engine lost its worker and waits for it to come back (RECOVERING: not ready); the
        # gateway stays ready, as requests sent now queue at the engine until the group is rebuilt;
        # the page still answers (the edge routes the console and /v1/status to replicas in any state).
        assert health["engine-0"] == "NOT_SERVING" and health["gateway"] == "SERVING"
        assert "127.0.0.1" in page.inner_text("#roles tr[data-name='worker-0.0']")
        assert page.inner_text("#status-error") == ""
        context.close()


def _save_screenshot(page, name: str) -> None:
    """Save the page as ``name`` in $GRIDSERVE_CONSOLE_SCREENSHOTS (64 colours with Pillow: a third
    of the size, for the README)."""
    folder = os.environ.get("GRIDSERVE_CONSOLE_SCREENSHOTS")
    if not folder:
        return
    path = Path(folder) / name
    page.screenshot(path=str(path))
    try:
        from PIL import Image
    except ImportError:
        return
    with Image.open(path) as image:
        palette = image.convert("RGB").quantize(colors=64, method=Image.Quantize.MEDIANCUT)
    palette.save(path, optimize=True)
