"""The settings table (``gridserve.shared.envs``): the only reader of ``GRIDSERVE_*`` variables."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from gridserve.shared import envs
from gridserve.shared.errors import ConfigError

REPO = Path(__file__).resolve().parents[3]
SCANNED = ("services", "shared", "kernels", "gridserve", "benchmarks", "demo")
TABLE = REPO / "shared" / "envs.py"


def _constants(tree: ast.Module) -> dict[str, str]:
    """Module-level ``NAME = "text"`` assignments (``ENV = "GRIDSERVE_X"``; ``os.environ.get(ENV)``)."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    out[target.id] = node.value.value
    return out


def _mentions_gridserve(node: ast.AST, constants: dict[str, str]) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Constant) and isinstance(sub.value, str) and sub.value.startswith("GRIDSERVE_"):
            return True
        if isinstance(sub, ast.Name) and constants.get(sub.id, "").startswith("GRIDSERVE_"):
            return True
    return False


def _is_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ"
            and isinstance(node.value, ast.Name) and node.value.id == "os")


def direct_reads(source: str) -> list[int]:
    """Lines that read a ``GRIDSERVE_*`` variable from ``os.environ`` / ``os.getenv`` (writes, and
    passing the whole environment to a child, are not reads)."""
    tree = ast.parse(source)
    constants = _constants(tree)
    lines = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            func = node.func
            if func.attr in ("get", "pop", "setdefault") and _is_environ(func.value) and node.args:
                key = node.args[0]
            elif func.attr == "getenv" and isinstance(func.value, ast.Name) and func.value.id == "os" and node.args:
                key = node.args[0]
        elif isinstance(node, ast.Subscript) and _is_environ(node.value) and isinstance(node.ctx, ast.Load):
            key = node.slice
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            key = node.left
        if key is not None and _mentions_gridserve(key, constants):
            lines.append(node.lineno)
    return lines


def test_the_scanner_finds_each_kind_of_direct_read():
    source = '''import os
ENV = "GRIDSERVE_B"
a = os.environ.get("GRIDSERVE_A", "1")
b = os.environ.get(ENV)
c = os.environ["GRIDSERVE_C"]
d = "GRIDSERVE_D" in os.environ
e = os.getenv("GRIDSERVE_" + "E")
os.environ["GRIDSERVE_F"] = "1"
env = {**os.environ, "GRIDSERVE_G": "1"}
h = os.environ.get("HOME")
'''
    assert direct_reads(source) == [3, 4, 5, 6, 7]


def test_no_module_reads_a_gridserve_variable_outside_the_settings_table():
    offenders = []
    for root in SCANNED:
        for path in sorted((REPO / root).rglob("*.py")):
            if path == TABLE or "_pb2" in path.name:
                continue
            for line in direct_reads(path.read_text(encoding="utf-8")):
                offenders.append(f"{path.relative_to(REPO)}:{line}")
    assert not offenders, ("read these through gridserve.shared.envs (add the variable to its table): "
                           + ", ".join(offenders))


def test_a_setting_is_read_when_used_not_at_import(monkeypatch):
    monkeypatch.delenv("GRIDSERVE_STEP_TIMEOUT_S", raising=False)
    assert envs.GRIDSERVE_STEP_TIMEOUT_S == 120.0
    monkeypatch.setenv("GRIDSERVE_STEP_TIMEOUT_S", "5")
    assert envs.GRIDSERVE_STEP_TIMEOUT_S == 5.0


def test_a_bad_value_names_the_variable(monkeypatch):
    monkeypatch.setenv("GRIDSERVE_STEP_TIMEOUT_S", "soon")
    with pytest.raises(ConfigError, match="GRIDSERVE_STEP_TIMEOUT_S"):
        _ = envs.GRIDSERVE_STEP_TIMEOUT_S
    monkeypatch.setenv("GRIDSERVE_KERNELS", "fastest")
    with pytest.raises(ConfigError, match="GRIDSERVE_KERNELS.*one of auto, reference, triton, cpu"):
        _ = envs.GRIDSERVE_KERNELS


def test_an_unknown_setting_is_an_attribute_error():
    with pytest.raises(AttributeError):
        _ = envs.GRIDSERVE_NO_SUCH_THING


def test_test_hooks_stay_off_without_the_one_test_switch(monkeypatch):
    monkeypatch.setenv("GRIDSERVE_TEST_GRAMMAR_FAULT", "boom")
    monkeypatch.setenv("GRIDSERVE_TEST_ENGINE_SIGUSR1_STOP", "1")
    monkeypatch.delenv(envs.TEST_HOOKS, raising=False)
    assert envs.GRIDSERVE_TEST_GRAMMAR_FAULT == "" and envs.GRIDSERVE_TEST_ENGINE_SIGUSR1_STOP is False
    monkeypatch.setenv(envs.TEST_HOOKS, "1")
    assert envs.GRIDSERVE_TEST_GRAMMAR_FAULT == "boom" and envs.GRIDSERVE_TEST_ENGINE_SIGUSR1_STOP is True


def test_every_test_only_variable_is_named_as_one():
    for var in envs.VARIABLES.values():
        assert var.test_only == var.name.startswith("GRIDSERVE_TEST_"), var.name


def test_a_flag_variable_is_parsed_with_the_flag_type_and_named_when_bad(monkeypatch):
    monkeypatch.setenv("GRIDSERVE_MAX_NUM_SEQS", "7")
    assert envs.flag_default("--max-num-seqs", 256, int) == 7
    monkeypatch.setenv("GRIDSERVE_MAX_NUM_SEQS", "many")
    with pytest.raises(ConfigError, match="GRIDSERVE_MAX_NUM_SEQS"):
        envs.flag_default("--max-num-seqs", 256, int)
