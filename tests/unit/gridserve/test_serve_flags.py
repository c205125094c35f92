"""``gridserve serve`` flags of issue 18: the edge's stream idle timeout must outlast a worker
recovery (a stream is silent while its engine rebuilds the worker group), and
``--max-waiting-requests`` / ``--request-timeout`` reach the engine and gateway command lines."""

from __future__ import annotations

import argparse

from gridserve.cli import main
from gridserve.roles import add_engine_arguments, engine_argv
from gridserve.services.gateway.limits import add_limit_arguments, gateway_argv


def test_a_stream_idle_timeout_shorter_than_a_worker_recovery_is_refused_naming_the_flag(capsys):
    assert main(["serve", "m", "--stream-idle-timeout", "60", "--worker-recovery-timeout", "120"]) == 2
    assert "stream-idle-timeout" in capsys.readouterr().err


def test_admission_and_deadline_flags_reach_the_roles():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    add_limit_arguments(parser)
    args = parser.parse_args(["--max-waiting-requests", "4", "--request-timeout", "30"])
    argv = engine_argv(args)
    assert argv[argv.index("--max-waiting-requests") + 1] == "4"
    assert gateway_argv(args)[-2:] == ["--request-timeout", "30.0"]


def test_a_role_that_exits_at_start_ends_serve_with_its_error_and_no_traceback(monkeypatch, capsys):
    """The role printed why it stopped (e.g. a config field it refused); ``serve`` says which role
    and exits 1, with every process stopped, instead of raising."""
    from gridserve import launcher

    stopped = []

    def start(self):
        raise launcher.RoleStartError("the engine (pid 1) exited with 2 during startup")

    monkeypatch.setattr(launcher.Launcher, "start", start)
    monkeypatch.setattr(launcher.Launcher, "stop", lambda self: stopped.append(True))
    assert main(["serve", "m"]) == 1
    err = capsys.readouterr().err
    assert "gridserve serve: error: the engine (pid 1) exited with 2 during startup" in err
    assert "Traceback" not in err and stopped == [True]
