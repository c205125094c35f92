"""No import cycles among gridserve's own modules, as Python runs them at import time.

The graph is read from the source (``ast``) over every folder ``setup.py`` maps into the
``gridserve`` namespace (``services/``, ``shared/``, ``kernels/``, ``gridserve/``, ...). Only
module-level imports are edges: an import inside a function runs when it is called (a lazy import,
the way to break a cycle), and one under ``if TYPE_CHECKING:`` never runs. ``from pkg import name``
is an edge to ``pkg.name`` when that is a module, else to ``pkg``; an edge to one of the importing
module's own parent packages is dropped (a package is always in ``sys.modules`` before its
submodules run, so a submodule reading its package is no cycle).
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.unit.gridserve.test_layering import source_modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _module_level_imports(body: list[ast.stmt]):
    """The ``Import`` / ``ImportFrom`` statements that run when the module is imported."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _module_level_imports(node.orelse)
        else:  # class bodies, try / if / with blocks: they run at import
            for field in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(node, field, []):
                    yield from _module_level_imports(child.body if isinstance(child, ast.ExceptHandler) else [child])


def _resolve(target: str, modules: dict[str, Path]) -> str | None:
    """The longest known module ``target`` names (``pkg.mod.func`` -> ``pkg.mod``), or None."""
    parts = target.split(".")
    while parts and ".".join(parts) not in modules:
        parts.pop()
    return ".".join(parts) if parts else None


def eager_import_graph() -> dict[str, set[str]]:
    """Module -> the gridserve modules its module-level code imports."""
    modules = source_modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in _module_level_imports(ast.parse(path.read_text(), filename=str(path)).body):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
                continue
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
        edges = {_resolve(t, modules) for t in targets if t == "gridserve" or t.startswith("gridserve.")}
        graph[name] = {t for t in edges if t and t != name and not name.startswith(t + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (``a -> b -> ... -> a``) per strongly connected component of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def visit(node: str) -> None:  # Tarjan; the graph is a few hundred modules deep at most
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_cycle_in(component, graph) for component in components]


def _cycle_in(component: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest path from the component's first module back to itself, inside the component."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for target in sorted(graph[node] & component):
                if target == start:
                    return [*paths[node], start]
                if target not in paths:
                    paths[target] = [*paths[node], target]
                    following.append(target)
        frontier = following
    raise AssertionError(f"no cycle through {start}")


def test_gridserve_has_no_import_cycles():
    found = cycles(eager_import_graph())
    assert not found, "import cycles (break one edge: move the shared types out, or import lazily):\n" + "\n".join(
        " -> ".join(cycle) for cycle in found)


def test_the_check_finds_a_cycle_and_ignores_lazy_imports():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    tree = ast.parse("import x\nif TYPE_CHECKING:\n    import y\ndef f():\n    import z\n"
                     "class C:\n    import w\ntry:\n    import v\nexcept ImportError:\n    import u\n")
    names = {alias.name for node in _module_level_imports(tree.body) for alias in node.names}
    assert names == {"x", "w", "v", "u"}


def test_the_graph_holds_the_real_imports_and_a_new_back_edge_is_a_cycle():
    graph = eager_import_graph()
    worker = "gridserve.services.worker"
    assert f"{worker}.checkpoint" in graph[f"{worker}.parallel_layers"]
    assert f"{worker}.worker" in graph[f"{worker}.extension"]
    assert f"{worker}.extension" not in graph[f"{worker}.worker"]  # its import would close a cycle
    closed = {**graph, f"{worker}.worker": graph[f"{worker}.worker"] | {f"{worker}.extension"}}
    assert [f"{worker}.extension", f"{worker}.worker", f"{worker}.extension"] in cycles(closed)
