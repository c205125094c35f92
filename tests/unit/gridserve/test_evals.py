"""gridserve.evals without a model: the chat question set and its match rule, what a model argument
names, the default files, and that ``gridserve eval`` does not need ``gridserve.demo``."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from gridserve.cli import _parser
from gridserve.evals import chat, perplexity
from gridserve.evals.models import resolve_model
from gridserve.shared.errors import InvalidArgumentError

REPO = Path(__file__).resolve().parents[3]


def test_the_question_set_has_twenty_questions_each_with_expected_answers() -> None:
    questions = chat.load_questions()
    assert len(questions) == 20
    assert len({q.question for q in questions}) == 20
    assert all(q.expect and all(options for options in q.expect) for q in questions)


@pytest.mark.parametrize(("expect", "answer", "passes"), [
    (["paris"], "The capital of France is Paris.", True),
    (["paris"], "Lyon.", False),
    ([["4", "four"]], "Two plus two is FOUR.", True),
    (["def", ["** 2", "**2"]], "def square(x):\n    return x**2", True),
    (["def", ["** 2", "**2"]], "def square(x):\n    return x ** 0", False),
    (["def", "[::-1]"], "return s[::-1]", False),  # every entry is required
])
def test_an_answer_passes_when_it_contains_every_entry_case_insensitively(expect, answer, passes) -> None:
    question = chat._question({"question": "q", "expect": expect}, "test")
    assert question.passes(answer) is passes
    assert question.to_dict()["expect"] == expect


@pytest.mark.parametrize("line", ['{"question": "q"}', '{"question": "", "expect": ["a"]}',
                                  '{"question": "q", "expect": []}', '{"question": "q", "expect": [["a", 1]]}'])
def test_a_malformed_question_names_its_line(tmp_path: Path, line: str) -> None:
    path = tmp_path / "set.jsonl"
    path.write_text('{"question": "fine", "expect": ["x"]}\n' + line + "\n")
    with pytest.raises(InvalidArgumentError) as err:
        chat.load_questions(path)
    assert err.value.field == "questions" and "set.jsonl:2" in err.value.message


def test_a_model_argument_that_is_neither_gguf_nor_folder_is_refused(tmp_path: Path) -> None:
    text = tmp_path / "notes.md"
    text.write_text("hello")
    for model in (text, tmp_path, tmp_path / "missing.gguf"):
        with pytest.raises(InvalidArgumentError) as err:
            resolve_model(model)
        assert err.value.field == "model"


def test_other_models_score_the_repository_prose_by_default() -> None:
    assert perplexity.default_files(None) == [REPO / "README.md", REPO / "docs" / "getting-started.md"]


def test_eval_perplexity_defaults_to_the_default_model() -> None:
    args = _parser().parse_args(["eval", "perplexity"])
    assert (args.model, args.files) == (None, [])
    args = _parser().parse_args(["eval", "perplexity", "m.gguf", "a.txt", "b.txt"])
    assert (args.model, [str(f) for f in args.files]) == ("m.gguf", ["a.txt", "b.txt"])


def test_eval_chat_without_a_server_fails_naming_the_base_url(capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("openai")
    from gridserve.cli import main
    from gridserve.launcher import free_port

    assert main(["eval", "chat", "--base-url", f"http://127.0.0.1:{free_port()}/v1", "--timeout", "5"]) == 2
    assert "base_url: no OpenAI server answers" in capsys.readouterr().err


def test_eval_chat_names_the_flag_a_refusing_server_blames(capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("openai")
    from gridserve.cli import main

    class Refuse(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = b'{"error": {"message": "bad key", "type": "auth"}}'
            self.send_response(401)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        assert main(["eval", "chat", "--base-url", url, "--model", "m", "--timeout", "5"]) == 2
    finally:
        server.shutdown()
        server.server_close()
    assert "api_key: " in capsys.readouterr().err


def test_the_eval_commands_do_not_import_the_demo_package() -> None:
    code = ("import json, sys; import gridserve.cli, gridserve.evals.chat, gridserve.evals.perplexity; "
            "print(json.dumps([m for m in sys.modules if m.startswith('gridserve.demo')]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO,
                         check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
