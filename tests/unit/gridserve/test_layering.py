"""The layering rules, checked on the import graph of the source tree and in fresh interpreters.

The graph is read from the source (``ast``), not from ``sys.modules``: every ``import`` at any depth
(lazy, function-level ones included) and every module named by a string (``importlib.import_module``
literals, ``"pkg.mod:Class"`` registries) is an edge. Module names follow ``setup.py``'s mapping of
the ``gridserve`` namespace onto the top-level folders, which static tools that walk one package
folder cannot see. ``RULES`` below is the table in ``docs/design/architecture.md`` ("Import rules"); a test
keeps the two the same.

Because the static graph can miss what only runs (``__path__`` tricks, a plugin), each role's entry
point is also imported in a fresh interpreter and its ``sys.modules`` checked.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
ROLES = ("gateway", "engine", "worker", "coordinator")
TOP_LEVEL = ("edge", "launcher", "cli", "llm", "llm_engine", "async_llm", "local_engine_client", "roles",
             "protos_build", "demo", "benchmarks", "evals", "default_model", "supported_models")
TORCH_FREE = ("gateway", "engine", "coordinator")


@dataclass(frozen=True)
class Rule:
    """Modules under ``source`` must not reach (directly, or through other modules with
    ``transitive``) any module under one of ``forbidden``."""

    source: str
    forbidden: tuple[str, ...]
    transitive: bool = False


RULES = [
    *(Rule(f"gridserve.services.{role}",
           tuple(f"gridserve.services.{other}" for other in ROLES if other != role)) for role in ROLES),
    Rule("gridserve.services", tuple(f"gridserve.{name}" for name in TOP_LEVEL)),
    Rule("gridserve.shared", ("gridserve.services", *(f"gridserve.{name}" for name in TOP_LEVEL))),
    Rule("gridserve.kernels", ("gridserve.services", *(f"gridserve.{name}" for name in TOP_LEVEL))),
    *(Rule(f"gridserve.services.{role}", ("torch", "triton", "gridserve.kernels"), transitive=True)
      for role in TORCH_FREE),
    Rule("gridserve.shared", ("torch", "triton", "gridserve.kernels"), transitive=True),
]

_STRING_MODULE = re.compile(r"^(gridserve(?:\.\w+)+)(?::\w+)?$")


def _roots() -> dict[str, Path]:
    """``ROOTS`` from setup.py: import prefix -> folder."""
    tree = ast.parse((REPO / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "ROOTS":
            return {name: REPO / folder for name, folder in ast.literal_eval(node.value).items()}
    raise AssertionError("setup.py has no ROOTS mapping")


def source_modules() -> dict[str, Path]:
    """Every module of the namespace (generated code excluded) -> its file."""
    modules: dict[str, Path] = {}
    roots = _roots()
    for prefix, folder in roots.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if path.name.endswith(("_pb2.py", "_pb2_grpc.py")) or (prefix == "gridserve" and parts[:1] == ["api"]):
                continue
            modules[".".join([prefix, *parts])] = path
    return modules


def _imports_of(name: str, path: Path, source: str | None = None) -> set[str]:
    tree = ast.parse(path.read_text() if source is None else source, filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            match = _STRING_MODULE.match(node.value)
            if match:
                found.add(match.group(1))
    return found


def import_graph(extra: dict[str, str] | None = None) -> dict[str, set[str]]:
    """Module -> the modules (internal, resolved to the longest known name) or external top-level
    packages it imports. ``extra`` maps module names to source added for a test."""
    modules = source_modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        raw = _imports_of(name, path)
        if extra and name in extra:
            raw |= _imports_of(name, path, extra[name])
        edges = set()
        for target in raw:
            if _under(target, "gridserve.api"):  # generated contracts: allowed everywhere
                continue
            if target == "gridserve" or target.startswith("gridserve."):
                parts = target.split(".")
                while parts and ".".join(parts) not in modules:
                    parts.pop()
                if parts:
                    edges.add(".".join(parts))
            else:
                edges.add(target.split(".")[0])
        # Every module runs the namespace root's __init__ anyway; what that runs eagerly is checked
        # by test_the_namespace_root_imports_only_shared_code, its lazy `LLM` is the offline API's.
        edges.discard("gridserve")
        graph[name] = edges - {name}
    return graph


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def violations(graph: dict[str, set[str]]) -> list[str]:
    found = []
    for rule in RULES:
        for module in (m for m in graph if _under(m, rule.source)):
            seen, frontier, via = {module}, [module], {module: None}
            while frontier:
                current = frontier.pop()
                for target in graph.get(current, ()):
                    if any(_under(target, f) for f in rule.forbidden):
                        chain = [target, current]
                        while via[chain[-1]] is not None:
                            chain.append(via[chain[-1]])
                        found.append(f"{rule.source} must not reach {target}: "
                                     + " -> ".join(reversed(chain)))
                    elif rule.transitive and target in graph and target not in seen:
                        seen.add(target)
                        via[target] = current
                        frontier.append(target)
    return sorted(set(found))


def test_the_source_tree_keeps_every_import_rule():
    assert violations(import_graph()) == []


def test_the_namespace_root_imports_only_shared_code():
    tree = ast.parse((REPO / "gridserve" / "__init__.py").read_text())
    eager = {n.module for n in tree.body if isinstance(n, ast.ImportFrom) and n.module}
    eager |= {a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names}
    assert all(m in ("__future__", "pathlib") or _under(m, "gridserve.shared") for m in eager), eager


@pytest.mark.parametrize(("module", "source", "expected"), [
    ("gridserve.services.gateway.router", "from gridserve.services.engine import scheduler",
     "gridserve.services.gateway must not reach gridserve.services.engine.scheduler"),
    ("gridserve.services.engine.scheduler", "import torch", "must not reach torch"),
    ("gridserve.shared.config", "from gridserve import launcher", "must not reach gridserve.launcher"),
    # at any depth: shared -> kernels -> torch is caught at its first forbidden step
    ("gridserve.shared.outputs", "from gridserve.kernels import reference", "must not reach gridserve.kernels"),
])
def test_a_forbidden_import_is_reported(module, source, expected):
    problems = violations(import_graph(extra={module: source}))
    assert any(expected in p for p in problems), problems


def test_a_forbidden_import_two_steps_away_is_reported_with_its_chain():
    # gateway -> shared.outputs (allowed) -> torch (forbidden for the gateway, reached indirectly)
    problems = violations(import_graph(extra={"gridserve.shared.outputs": "import torch"}))
    assert any("gridserve.services.gateway" in p and "gridserve.shared.outputs -> torch" in p
               for p in problems), problems


def test_the_architecture_page_lists_the_same_rules():
    text = (REPO / "docs" / "design" / "architecture.md").read_text()
    section = text.split("## Import rules", 1)[1].split("\n## ", 1)[0]
    rows = {tuple(cell.strip().strip("`") for cell in line.strip("|").split("|")[:3])
            for line in section.splitlines() if line.startswith("| `")}
    expected = {(r.source, ", ".join(r.forbidden), "any depth" if r.transitive else "direct")
                for r in RULES}
    assert rows == expected


ENTRY_POINTS = {role: f"gridserve.services.{role}.main" for role in ROLES}


@pytest.mark.parametrize("role", ROLES)
def test_each_role_entry_point_loads_only_its_own_service(role):
    code = (f"import importlib, json, sys; importlib.import_module({ENTRY_POINTS[role]!r}); "
            "print(json.dumps(sorted(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=REPO, check=True)
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    others = [m for m in loaded if any(_under(m, f"gridserve.services.{o}") for o in ROLES if o != role)]
    assert others == [], f"{role} loads another service's modules"
    top = [m for m in loaded if any(_under(m, f"gridserve.{t}") for t in TOP_LEVEL)]
    assert top == [], f"{role} loads top-level modules"
    if role in TORCH_FREE:
        heavy = [m for m in loaded if m.split(".")[0] in ("torch", "triton") or _under(m, "gridserve.kernels")]
        assert heavy == [], f"{role} loads {heavy[:5]}"
