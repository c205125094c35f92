"""``kernels`` as a top-level name belongs to another distribution (Hugging Face's ``kernels``, which
transformers >= 5.25 imports); a process started from this checkout's root must get that one, not
this checkout's ``kernels/`` folder (``gridserve.kernels``), which it would otherwise shadow."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gridserve.kernels

ROOT = Path(gridserve.kernels.__file__).resolve().parent.parent


def _run(code: str, extra_path: Path | None = None) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(extra_path) if extra_path else "", "PATH": "/usr/bin:/bin"}
    # ``python -c`` from the root puts the root first on sys.path, as ``python -m`` and pytest do
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def test_import_kernels_from_the_checkout_root_gets_the_installed_distribution(tmp_path):
    fake = tmp_path / "site" / "kernels"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("MARKER = 'the real kernels'\nfrom kernels.sub import VALUE\n")
    (fake / "sub.py").write_text("VALUE = 42\n")
    result = _run("import kernels, gridserve.kernels as ours\n"
                  "print(kernels.MARKER, kernels.VALUE, kernels.__file__)\n"
                  "print(ours.rms_norm.__module__)", extra_path=tmp_path / "site")
    assert result.returncode == 0, result.stderr
    first, second = result.stdout.splitlines()
    assert first.startswith("the real kernels 42 ") and str(fake) in first
    assert second == "gridserve.kernels.dispatch"  # the checkout's package is untouched


def test_transformers_loads_from_the_checkout_root_with_or_without_that_distribution():
    """transformers >= 5.25 imports the installed ``kernels`` when it loads; older ones probe the name
    by importing it and read no version from this folder (not available). Either way it loads."""
    result = _run("import importlib.metadata\n"
                  "try:\n"
                  "    importlib.metadata.version('kernels')\n"
                  "    installed = True\n"
                  "except importlib.metadata.PackageNotFoundError:\n"
                  "    installed = False\n"
                  "from transformers import LlamaConfig\n"
                  "import kernels\n"
                  "print(installed, kernels.__file__)")
    assert result.returncode == 0, result.stderr
    installed, where = result.stdout.split()
    ours = Path(where).resolve() == ROOT / "kernels" / "__init__.py"
    assert ours == (installed == "False")  # the installed one whenever there is one
