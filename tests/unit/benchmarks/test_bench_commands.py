"""The benchmarks as tools: every ``gridserve bench NAME`` answers ``--help``, every module under
``benchmarks/`` is a command's or a library of one, the CLI stays import-light and says so clearly
when the package is absent (the runtime images), and every committed result is documented."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gridserve.benchmarks import BENCHMARKS, LIBRARIES
from gridserve.cli import main

REPO = Path(__file__).resolve().parents[3]
BENCH = REPO / "benchmarks"
DOCS = REPO / "docs" / "benchmarks"
# Run on a lent GPU / quiet machine (not commands; they call `gridserve bench ...` themselves).
DEVICE_SCRIPTS = {"gpu_check.sh", "gpu_env.sh", "gpu_quant_check.sh", "int8_gemm_device.sh"}


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_every_bench_command_answers_help(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", name, "--help"])
    assert exit_info.value.code == 0
    assert f"usage: gridserve bench {name}" in capsys.readouterr().out


def _imports(path: Path) -> set[str]:
    """gridserve.benchmarks.X modules a file imports (lazy imports too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module == "gridserve.benchmarks":
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gridserve.benchmarks."):
            found.add(node.module.split(".")[2])
    return found


def test_every_module_is_a_command_or_a_library_of_one() -> None:
    commands = {module for module, *_ in BENCHMARKS.values()}
    modules = {p.stem for p in BENCH.glob("*.py")} - {"__init__"}
    assert not commands - modules, f"the table names missing modules: {sorted(commands - modules)}"
    stray = modules - commands - set(LIBRARIES)
    assert not stray, f"benchmarks/ modules that are neither a bench command nor a listed library: {stray}"
    imported = set().union(*(_imports(BENCH / f"{m}.py") for m in commands | set(LIBRARIES)))
    unused = set(LIBRARIES) - imported
    assert not unused, f"libraries no command imports: {unused}"
    scripts = {p.name for p in BENCH.glob("*.sh")}
    assert scripts == DEVICE_SCRIPTS, f"shell scripts beside the benchmarks: {sorted(scripts ^ DEVICE_SCRIPTS)}"
    assert not [p for p in BENCH.iterdir() if p.is_dir() and p.name not in ("results", "__pycache__")]


def test_int8_gemm_isa_names_match_the_kernel() -> None:
    from gridserve.benchmarks import int8_gemm_bench
    from gridserve.kernels.cpu_ops import int8_gemm

    assert int8_gemm_bench.ISA_NAMES == int8_gemm.ISA_NAMES


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, cwd=str(REPO))


def test_building_the_cli_imports_no_heavy_module() -> None:
    result = _python("""
        import sys
        from gridserve.cli import _parser
        _parser()
        heavy = sorted(m for m in ("torch", "numpy", "PIL", "transformers", "triton") if m in sys.modules)
        assert not heavy, heavy
    """)
    assert result.returncode == 0, result.stderr[-3000:]


def test_bench_says_so_when_the_benchmarks_are_not_installed() -> None:
    result = _python("""
        import sys
        sys.modules["gridserve.benchmarks"] = None  # as in the runtime images: the package is absent
        from gridserve.cli import main
        assert main(["bench"]) == 2
        assert main(["bench", "throughput", "--num-prompts", "4"]) == 2
    """)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("benchmarks are not installed in this image") == 2


def test_every_committed_result_is_documented() -> None:
    docs = "\n".join(p.read_text() for p in DOCS.glob("*.md"))
    results = BENCH / "results"
    undocumented = [str(p.relative_to(results)) for p in sorted(results.rglob("*"))
                    if p.is_file() and str(p.relative_to(results)) not in docs]
    assert not undocumented, f"results no page of docs/benchmarks names (delete or document): {undocumented}"
